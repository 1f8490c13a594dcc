"""The command line as a user types it: outputs, multirun, torchrun, and every bad-input case
ending in one clear message (non-zero exit, no traceback)."""

import json
import re
import socket
import subprocess
import sys

import pytest
import torch

from tests.conftest import CPU, assert_same_model, cli, on_cpu

pytestmark = pytest.mark.timeout(300)
QUICK = ["train.steps=20", "train.log_every=10", "data.size=2048", "data.test_size=256"]


def _clean_error(result, *needles):
    assert result.returncode != 0
    out = result.stdout + result.stderr
    assert "Traceback" not in out, out
    for n in needles:
        assert n in out, out


@pytest.mark.parametrize("args, needles", [
    (["cluster.num_ps=0"], ["cluster.num_ps=0", "at least 1 parameter server"]),
    (["cluster.num_workers=0"], ["cluster.num_workers=0", "at least 1 worker"]),
    (["update=bogus"], ["update/bogus", "Available options in 'update'", "async", "sync"]),
    (["model=bogus"], ["model/bogus", "cnn", "mlp", "resnet18"]),
    (["cluster.bogus=1"], ["cluster.bogus: not a key of psrpc's config", "--help lists"]),
    (["cluster.num_wrkers=3"], ["did you mean cluster.num_workers?"]),
    (["train.steps=abc"], ["train.steps", "could not be converted to Integer"]),
    (["update.replicas_to_aggregate=5"], ["update.replicas_to_aggregate=5", "1..2"]),
    (["parallel=model", "cluster.num_workers=3"],
     ["cluster.num_workers=3", "multiple of parallel.stages=2"]),
    (["parallel=model", "parallel.stages=4", "cluster.num_workers=4"],
     ["parallel.stages=4", "only 3 layers with parameters"]),
    (["parallel=model", "parallel.microbatches=5"],
     ["parallel.microbatches=5", "divide train.batch_size=32"]),
    (["data=mnist", "data.root=/no/such/dir"],
     ["data.root='/no/such/dir'", "/no/such/dir/MNIST/raw/train-images-idx3-ubyte",
      "data.download=true"]),
    # the rest of validate's checks are unit tests in test_config.py
    (["optim.lr=-1"], ["optim.lr=-1.0", "must be a finite number ≥ 0"]),
    (["hooks=[{_target_: no.such.Hook}]"],
     ["hooks[0]._target_='no.such.Hook'", "cannot import it", "No module named 'no'"]),
    (["cluster.transports=[uv,tcp]"],  # a retired key: its variable, checked as it was
     ["cluster.transports is retired", "PSRPC_TP_TRANSPORTS='uv,tcp'", "['uv', 'shm', 'ibv']"]),
    pytest.param(["train.device=cuda"], ["train.device='cuda'", "CUDA is not available"],
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here")),
])
def test_bad_config_one_clear_message(tmp_path, args, needles):
    r = cli(args, tmp_path, timeout=60)
    _clean_error(r, *needles)
    # caught before any rank started: every line a rank logs starts with its name
    assert not re.search(r"^\[(ps|worker)\d+\]", r.stderr, re.M), r.stderr
    assert not (tmp_path / "outputs").exists() or not any((tmp_path / "outputs").rglob("*.json"))


def test_busy_master_port_named(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = cli(QUICK, tmp_path, timeout=60, env={"MASTER_PORT": str(port)})
    _clean_error(r, f"MASTER_PORT={port}", "port busy")


def test_world_size_mismatch_under_torchrun(tmp_path):
    """3 processes for P + W = 4: each rank says so before any RPC starts."""
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=3",
                        "-m", "psrpc", "cluster.num_workers=3", CPU], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert ("WORLD_SIZE=3 but cluster.num_ps=1 + cluster.num_workers=3 = 4" in r.stderr), r.stderr
    # our ranks print one line; what follows is torchrun's own failure report
    assert "psrpc/" not in r.stderr.split("Traceback")[0]


def test_default_run_writes_the_contract_outputs(tmp_path):
    r = cli(QUICK, tmp_path)
    assert r.returncode == 0, r.stderr
    (run_dir,) = [p.parent for p in (tmp_path / "outputs").rglob("summary.json")]
    assert {"summary.json", "metrics.jsonl", "model.pt", ".hydra", "logs"} <= {
        p.name for p in run_dir.iterdir()}
    assert sorted(p.name for p in (run_dir / "logs").iterdir()) == [
        "ps0.log", "worker0.log", "worker1.log"]
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [10, 20] and all("samples_per_s" in x for x in lines)
    assert "[worker0] step    10/20 | epoch   0.31 | loss" in r.stderr  # the progress line


def test_multirun_gives_each_job_its_own_outputs(tmp_path):
    r = cli(["-m", "update=sync,async"] + QUICK, tmp_path)
    assert r.returncode == 0, r.stderr
    summaries = sorted((tmp_path / "multirun").rglob("summary.json"))
    assert len(summaries) == 2 and summaries[0].parent != summaries[1].parent
    assert sorted(json.loads(s.read_text())["update"] for s in summaries) == ["async", "sync"]


def test_torchrun_gives_the_same_model_as_the_local_launcher(tmp_path):
    args = QUICK + ["train.batch_size=16"]
    local = cli(args + [f"out_dir={tmp_path / 'local'}"], tmp_path)
    assert local.returncode == 0, local.stderr
    tr = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=3",
                         "-m", "psrpc", *on_cpu(args)], cwd=tmp_path, capture_output=True,
                        text=True, timeout=180)
    assert tr.returncode == 0, tr.stderr
    # every rank agreed on one run directory (not one per rank's ${now}); only the chief wrote
    (run_dir,) = {p.parent.parent for p in (tmp_path / "outputs").rglob("*.log")}
    assert sorted(p.name for p in (run_dir / "logs").iterdir()) == [
        "ps0.log", "worker0.log", "worker1.log"]
    a = torch.load(tmp_path / "local" / "model.pt", weights_only=True)
    b = torch.load(run_dir / "model.pt", weights_only=True)
    assert_same_model(a, b, rtol=0, atol=0)
    assert "[worker0] done: 20 steps" in tr.stderr
