"""Shared test helpers: compose a config exactly as the CLI does, run a real cluster, and check
that no test leaves a process behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
MNIST_ROOT = ROOT.parent / "shared" / "data"

# Small and quick: the CPU suite runs many clusters on 2 cores.
# The built-in synthetic data's sizes: dropped where a test gives a data factory of its own (an
# override of data.* applies to a factory given from Python, and that one takes its own keys).
SYNTHETIC = ["data.size=2048", "data.test_size=256"]
FAST = ["train.steps=20", "train.batch_size=16", "train.log_every=10", "train.untimed_steps=2",
        *SYNTHETIC, "update.timeout_s=30"]
# The suite runs on CPU even where CUDA is (train.device=auto would take it): its comparisons are
# bit-exact or nearly, which only holds for the same kernels. A test that wants CUDA says
# train.device=cuda (test_gpu.py).
CPU = "train.device=cpu"


# PSRPC_TEST_SHM=off pytest: every cluster a test composes goes over TCP instead of shared
# memory (unless the test chooses cluster.shm itself): the contracts hold both ways.
SHM = os.environ.get("PSRPC_TEST_SHM")


# One intra-op thread per worker unless a test chooses: a GEMM's rounding depends on how many
# threads split it, so the exact comparisons across numbers of workers (W × B against one worker
# accumulating W micro-batches of B) compare runs whose workers use the same count. (By default
# a worker takes its host's cores divided among the workers on it: 2 with W=1, 1 with W=2 here.)
THREADS = "cluster.worker_threads=1"


def on_cpu(overrides) -> list[str]:
    """`overrides`, plus train.device=cpu and one thread per worker (THREADS) unless they
    choose a device (or the threads), and cluster.shm when PSRPC_TEST_SHM says."""
    overrides = list(overrides)
    if SHM and not any(o.startswith("cluster.shm=") for o in overrides):
        overrides.append(f"cluster.shm={SHM}")
    if any(o.startswith("train.device=") for o in overrides):
        return overrides
    if not any(o.startswith("cluster.worker_threads=") for o in overrides):
        overrides.append(THREADS)
    return overrides + [CPU]


def compose(overrides=(), check: bool = True, **factories):
    """The typed Config that `python -m psrpc <overrides>` would run (on CPU unless the
    overrides choose a device), checked as the CLI checks it before starting."""
    from psrpc.api import compose as psrpc_compose
    from psrpc.validate import check_run

    if factories.get("data") is not None:
        overrides = [o for o in overrides if o not in SYNTHETIC]
    cfg = psrpc_compose(on_cpu(overrides), cwd=str(ROOT), **factories)
    if check:
        check_run(cfg)
    return cfg


def run_cluster(out_dir: Path, overrides=(), timeout_s: float = 240, fast: bool = True,
                **factories):
    """Run a whole local cluster through the real launcher; returns (summary, model state)."""
    from psrpc.launch import launch

    cfg = compose((FAST if fast else []) + list(overrides), **factories)
    launch(cfg, Path(out_dir), timeout_s=timeout_s)
    return read_outputs(out_dir)


def read_outputs(out_dir: Path):
    summary = json.loads((Path(out_dir) / "summary.json").read_text())
    state = torch.load(Path(out_dir) / "model.pt", weights_only=True)
    return summary, state


def assert_same_model(a: dict, b: dict, rtol=1e-4, atol=1e-5) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=atol, msg=lambda m: f"{k}: {m}")


def assert_equal_model(a: dict, b: dict) -> None:
    """Bit for bit: for the contracts that are exact (reruns, number of PS, resume)."""
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k}: differs by {(a[k] - b[k]).abs().max().item()}"


def models_differ(a: dict, b: dict, atol=1e-3) -> bool:
    return any(not torch.allclose(a[k], b[k], atol=atol) for k in a)


def cli(args, cwd: Path, timeout: float = 240, env=None) -> subprocess.CompletedProcess:
    """`python -m psrpc <args>` in a subprocess, as a user would type it (plus train.device=cpu
    unless the args choose a device)."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "psrpc", *on_cpu(args)], cwd=cwd, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


def _process_table() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, state) for every process."""
    table = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        table[int(stat.parent.name)] = (int(fields[1]), fields[0])
    return table


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


# multiprocessing's own long-lived helpers, shared by every cluster of the session
_HELPERS = ("multiprocessing.forkserver", "multiprocessing.resource_tracker")


def _leftovers() -> list[str]:
    """Processes this test session started that still run, multiprocessing's helpers aside
    (the ranks forked by the forkserver are its children, and are counted)."""
    table = _process_table()
    me, alive, todo = os.getpid(), [], [os.getpid()]
    seen = set()
    while todo:
        parent = todo.pop()
        for pid, (ppid, state) in table.items():
            if ppid != parent or pid in seen:
                continue
            seen.add(pid)
            todo.append(pid)
            cmd = _cmdline(pid)
            if state == "Z" or (ppid == me and any(h in cmd for h in _HELPERS)):
                continue
            alive.append(f"{pid}: {cmd[:120]}")
    return alive


@pytest.fixture(autouse=True)
def knobs_restored():
    """psrpc/knobs.py's environment variables as they were before each test: a retired key
    composed in this process sets one (psrpc/keys.py), and it would outlive the test."""
    from psrpc import knobs

    before = knobs.given()
    yield
    knobs.adopt(before)


@pytest.fixture(autouse=True)
def no_process_left_behind():
    """Every test: once it is over, none of its processes may still run."""
    yield
    deadline = time.monotonic() + 10
    left = _leftovers()
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = _leftovers()
    assert not left, f"processes left behind: {left}"


@pytest.fixture
def gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
