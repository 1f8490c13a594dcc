"""Many nodes and SLURM, on one machine: two torchrun agents (two "nodes"), tasks started as srun
starts them, and a sweep through Hydra's submitit launcher. Each run is real (ranks over RPC)."""

import ipaddress
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from psrpc.cluster import netif, slurm
from psrpc.launch import free_port
from tests.conftest import assert_equal_model, cli, on_cpu

pytestmark = pytest.mark.timeout(300)
QUICK = ["train.steps=20", "train.log_every=10", "train.batch_size=16", "data.size=2048",
         "data.test_size=256"]
# Variables a user may have set that would name another interface or launcher
FOREIGN = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TP_SOCKET_IFNAME",
           "GLOO_SOCKET_IFNAME", "SUBMITIT_EXECUTOR")


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in FOREIGN and not k.startswith("SLURM_")}
    return {**env, **extra}


def _ranks(parent: psutil.Process) -> dict[int, str]:
    """pid -> rank name (ps0, ...) of `parent` and every process below it that is a psrpc rank
    (named psrpc-<rank> by psrpc.process)."""
    found = {}
    try:
        procs = [parent, *parent.children(recursive=True)]
    except psutil.Error:  # gone
        return found
    for p in procs:
        try:
            if p.name().startswith("psrpc-"):
                found[p.pid] = p.name().removeprefix("psrpc-")
        except psutil.Error:
            pass
    return found


def _watch(procs, timeout_s: float):
    """Wait for `procs` (Popen) to end, meanwhile recording, for every psrpc rank below them,
    the node (index into procs) it runs under and every TCP address it listens on.
    Returns ({rank: node}, {rank: {address}})."""
    parents = [psutil.Process(p.pid) for p in procs]
    node_of, listens = {}, {}
    deadline = time.monotonic() + timeout_s
    while any(p.poll() is None for p in procs):
        assert time.monotonic() < deadline, "the run did not finish in time"
        for n, parent in enumerate(parents):
            for pid, rank in _ranks(parent).items():
                node_of[rank] = n
                try:
                    conns = psutil.Process(pid).net_connections(kind="inet")
                except psutil.Error:  # gone meanwhile
                    continue
                listens.setdefault(rank, set()).update(
                    c.laddr.ip for c in conns if c.status == psutil.CONN_LISTEN)
        time.sleep(0.1)
    return node_of, listens


def _stop(procs, files) -> None:
    """Kill the process groups these tests started (each in a session of its own) that still
    run, on failure; close their log files."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        p.wait(timeout=10)
    for f in files:
        f.close()


def _only_loopback(listens: dict) -> None:
    assert all(listens.values()), f"a rank never listened: {listens}"
    exposed = {r: sorted(a for a in addrs if not ipaddress.ip_address(a).is_loopback)
               for r, addrs in listens.items()}
    assert not any(exposed.values()), f"listening beyond loopback: {exposed}"


@pytest.mark.slow
def test_two_torchrun_nodes_give_the_local_launchers_model(tmp_path):
    """Two torchrun agents (--nnodes=2, c10d rendezvous on 127.0.0.1), two ranks each: 1 PS and
    3 workers, the PS and a worker on one node, two workers on the other. The model equals the
    local launcher's bit for bit, and every rank listens on the interface named (loopback) only;
    the agents' own stores are torchrun's (docs/security.md).

    cluster.worker_threads=1: by default a worker takes its node's cores divided among the
    node's workers (here 2 threads for worker0 beside ps0, 1 in the local launcher), and CPU
    kernels round differently with another thread count (1e-8 after 20 steps, measured)."""
    args = on_cpu(QUICK + ["cluster.num_workers=3", "cluster.worker_threads=1",
                           f"cluster.interface={netif.loopback_interface()}"])
    local = cli(args + [f"out_dir={tmp_path / 'local'}"], tmp_path)
    assert local.returncode == 0, local.stderr
    port = free_port()
    # the same command on both "nodes" (c10d ignores --node-rank: it numbers the nodes itself)
    errs = [open(tmp_path / f"node{node}.err", "w") for node in (0, 1)]
    agents = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2",
         "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=two-nodes",
         "--local-addr=127.0.0.1", "-m", "psrpc", *args], cwd=tmp_path, env=_env(),
        stdout=subprocess.DEVNULL, stderr=errs[node], start_new_session=True) for node in (0, 1)]
    try:
        node_of, listens = _watch(agents, timeout_s=180)
    finally:
        _stop(agents, errs)
    errs = "".join((tmp_path / f"node{n}.err").read_text() for n in (0, 1))
    assert [a.returncode for a in agents] == [0, 0], errs
    # torchrun gives each node a block of ranks (c10d sorts the nodes by address, then pid)
    nodes = sorted(sorted(r for r, n in node_of.items() if n == node) for node in (0, 1))
    assert nodes == [["ps0", "worker0"], ["worker1", "worker2"]], node_of
    _only_loopback(listens)
    a = torch.load(tmp_path / "local" / "model.pt", weights_only=True)
    b = torch.load(tmp_path / "outputs" / "torchrun" / "two-nodes" / "model.pt", weights_only=True)
    assert_equal_model(a, b)


def _slurm_job_id() -> int:
    """A job id whose port (slurm.port_for_job) is free here."""
    for job in random.sample(range(100000, 200000), 50):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", slurm.port_for_job(job)))
                return job
            except OSError:
                continue
    pytest.skip("no free port in psrpc's SLURM range")


def test_tasks_started_as_srun_starts_them_train_into_one_output_dir(tmp_path):
    """P + W `python -m psrpc` with the variables srun gives its tasks (no torchrun, no MASTER_*):
    each runs its own rank, task 0 hosts the store on the first node of the node list, all
    write into outputs/slurm/<job>.<step>/, and every listener is on the interface named."""
    job = _slurm_job_id()
    args = on_cpu(QUICK + [f"cluster.interface={netif.loopback_interface()}"])
    errs = [open(tmp_path / f"task{i}.err", "w") for i in range(3)]
    tasks = [subprocess.Popen(
        [sys.executable, "-m", "psrpc", *args], cwd=tmp_path, stdout=subprocess.DEVNULL,
        stderr=errs[i], start_new_session=True,
        env=_env(SLURM_JOB_ID=str(job), SLURM_STEP_ID="0", SLURM_PROCID=str(i),
                 SLURM_LOCALID=str(i), SLURM_NODEID="0", SLURM_NTASKS="3",
                 SLURM_TASKS_PER_NODE="3", SLURM_NODELIST="localhost",
                 SLURM_STEP_NODELIST="localhost")) for i in range(3)]
    try:
        node_of, listens = _watch(tasks, timeout_s=120)
    finally:
        _stop(tasks, errs)
    errs = "".join((tmp_path / f"task{i}.err").read_text() for i in range(3))
    assert [t.returncode for t in tasks] == [0, 0, 0], errs
    assert sorted(node_of) == ["ps0", "worker0", "worker1"]
    _only_loopback(listens)
    (run_dir,) = (tmp_path / "outputs").iterdir()
    assert run_dir.relative_to(tmp_path) == Path("outputs/slurm") and \
        [p.name for p in run_dir.iterdir()] == [f"{job}.0"]
    run_dir = run_dir / f"{job}.0"
    assert {"summary.json", "model.pt", ".hydra"} <= {p.name for p in run_dir.iterdir()}
    assert sorted(p.name for p in (run_dir / "logs").iterdir()) == [
        "ps0.log", "worker0.log", "worker1.log"]
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 20


def test_multirun_under_srun_is_refused(tmp_path):
    r = cli(["-m", "update=sync,async"], tmp_path, timeout=60, env=_env(
        SLURM_JOB_ID="7", SLURM_PROCID="1", SLURM_NTASKS="3", SLURM_NODELIST="localhost"))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "multirun (-m) under torchrun or srun would run the whole sweep on every" in r.stderr


def test_submitit_local_sweep_runs_a_job_per_point_and_a_task_per_rank(tmp_path):
    """`-m hydra/launcher=psrpc_submitit_local`: each sweep point is one submitit job of P + W
    tasks (tasks_per_node from cluster.num_ps + cluster.num_workers), each task runs its own
    rank (no local launcher inside), the tasks of a job share the job's output directory, and
    they listen on loopback (this machine's tasks; no interface named)."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    err = open(tmp_path / "sweep.err", "w")
    sweep_cmd = subprocess.Popen(
        [sys.executable, "-m", "psrpc", "-m", "hydra/launcher=psrpc_submitit_local",
         "update=sync,async", "cluster.num_workers=1", *on_cpu(QUICK)], cwd=tmp_path, env=_env(),
        stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    try:
        _, listens = _watch([sweep_cmd], timeout_s=180)
    finally:
        _stop([sweep_cmd], [err])
    assert sweep_cmd.returncode == 0, (tmp_path / "sweep.err").read_text()
    assert sorted(listens) == ["ps0", "worker0"]  # the ranks of both jobs
    _only_loopback(listens)
    (sweep,) = {p.parent.parent for p in (tmp_path / "multirun").rglob("summary.json")}
    for job, update in (("0", "sync"), ("1", "async")):
        assert json.loads((sweep / job / "summary.json").read_text())["update"] == update
        assert sorted(p.name for p in (sweep / job / "logs").iterdir()) == ["ps0.log",
                                                                             "worker0.log"]
    # one submitit job per point: its task 0 ran ps0 only, its task 1 worker0 only (a local
    # launcher in a task would start, and log, a whole cluster)
    jobs = sorted((sweep / ".submitit").glob("[0-9]*"))
    assert len(jobs) == 2
    for folder in jobs:
        ps, worker = [(folder / f"{folder.name}_{t}_log.err").read_text() for t in (0, 1)]
        assert "[ps0] ps0 is pid" in ps and "[worker0]" not in ps, ps
        assert "[worker0] done: 20 steps" in worker and "[ps0]" not in worker, worker


def test_uneven_nodes_for_the_submitit_launcher_is_one_line(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    r = cli(["-m", "hydra/launcher=psrpc_submitit_local", "hydra.launcher.nodes=2"], tmp_path,
            timeout=60, env=_env())
    assert r.returncode == 2 and r.stderr.strip() == (
        "psrpc: error: hydra.launcher.nodes=2: cluster.num_ps + cluster.num_workers = 3 ranks do "
        "not split evenly over 2 nodes (submitit starts as many tasks on every node)"), r.stderr
    assert not (tmp_path / "multirun").exists()  # nothing submitted


def test_exit_codes_tell_an_engine_whether_a_restart_helps(tmp_path):
    """Under srun (or a Kubernetes engine), a rank whose config is wrong exits 2 (starting it
    again cannot help); a PS whose chief was killed exits 138, Kubeflow's retryable code:
    started again, it would rejoin the run (psrpc/errors.py)."""
    job = _slurm_job_id()

    def task(i: int, args: list[str]) -> subprocess.Popen:
        with open(tmp_path / f"task{i}.err", "w") as err:
            return subprocess.Popen(
                [sys.executable, "-m", "psrpc", *args], cwd=tmp_path, stdout=subprocess.DEVNULL,
                stderr=err, start_new_session=True,
                env=_env(SLURM_JOB_ID=str(job), SLURM_STEP_ID="0", SLURM_PROCID=str(i),
                         SLURM_LOCALID=str(i), SLURM_NODEID="0", SLURM_NTASKS="2",
                         SLURM_TASKS_PER_NODE="2", SLURM_NODELIST="localhost",
                         SLURM_STEP_NODELIST="localhost"))

    bad = task(0, ["cluster.num_workers=1", "train.batch_size=0"])
    assert bad.wait(timeout=60) == 2, (tmp_path / "task0.err").read_text()
    # (a PS waits cluster.init_timeout_s for its engine to start the chief again)
    args = on_cpu(QUICK + ["cluster.num_workers=1", "train.steps=100000",
                           "cluster.init_timeout_s=10",
                           f"cluster.interface={netif.loopback_interface()}"])
    tasks = [task(i, args) for i in range(2)]
    try:
        log = tmp_path / "outputs" / "slurm" / f"{job}.0" / "logs" / "worker0.log"
        deadline = time.monotonic() + 120
        while not (log.exists() and "step" in log.read_text()):
            assert time.monotonic() < deadline and tasks[1].poll() is None, "never trained"
            time.sleep(0.2)
        os.killpg(tasks[1].pid, signal.SIGKILL)  # the chief (task 1: worker0)
        code = tasks[0].wait(timeout=120)
    finally:
        _stop(tasks, [])
    err = (tmp_path / "task0.err").read_text()
    assert code == 138, err
    assert "psrpc: error: ps0: lost contact with the chief" in err and "Traceback" not in err
