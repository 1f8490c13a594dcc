"""Emulated hosts (benchmarks/hosts.py): each is a machine of its own to psrpc (network, PIDs,
host name, /etc/hosts, /dev/shm, optionally its own disk), links can be shaped, cut and healed,
a host can lose power; nothing is left behind. And psrpc across them: two hosts under torchrun
give the local launcher's model bit for bit. Needs root; skips saying why otherwise."""

import json
import os
import re
import subprocess
import sys
import time

import psutil
import pytest
import torch

from benchmarks import hosts
from tests.conftest import assert_equal_model, cli, on_cpu

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(hosts.missing() is not None, reason=str(hosts.missing()))]
CONNECT = [sys.executable, "-c", "import socket, sys; s = socket.create_connection(('h0', 5000), "
           "timeout=2); print(s.recv(2).decode())"]
SERVE = [sys.executable, "-c", (
    "import socket\ns = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    "s.bind(('0.0.0.0', 5000)); s.listen(); print('up', flush=True)\n"
    "while True:\n    c, _ = s.accept(); c.sendall(b'hi'); c.close()")]


def _holders() -> list[psutil.Process]:
    """Processes of any emulation still running on this machine (the hosts' PID 1)."""
    out = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if cmd.startswith("ip netns exec " + hosts.PREFIX) or (
                "sleep infinity" in cmd and "mount --bind" in cmd):
            out.append(p)
    return out


def _env() -> dict:
    """This process's environment without what would name another launcher or job."""
    return {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in (
        "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}


def _wait(procs, timeout_s: float = 200) -> list:
    """Their exit codes once all have ended (None for one still running after `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.5)
    return [p.poll() for p in procs]


def _agents(h, tmp_path, args: list[str], rdzv_id: str, procs=(2, 2)) -> list:
    """A torchrun agent on each of the two hosts (procs[k] ranks on host k, the lowest ranks on
    h0; c10d on h0) running psrpc with `args`, its log in h<k>.err."""
    agents = []
    for k in range(2):
        with open(tmp_path / f"h{k}.err", "w") as err:  # (the agent keeps its own descriptor)
            agents.append(h.popen(k, [
                sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
                f"--nproc-per-node={procs[k]}", "--rdzv-backend=c10d",
                "--rdzv-endpoint=h0:29400", f"--rdzv-id={rdzv_id}", f"--local-addr={h.addr(k)}",
                "-m", "psrpc", *args], cwd=tmp_path, env=_env(), stdout=subprocess.DEVNULL,
                stderr=err))
    return agents


def _torchrun(h, tmp_path, args: list[str], rdzv_id: str, procs=(2, 2)) -> tuple[list, str]:
    """`_agents` running psrpc with `args` on eth1 to their end: their exit codes and logs."""
    codes = _wait(_agents(h, tmp_path, args + ["cluster.interface=eth1"], rdzv_id, procs))
    return codes, "".join((tmp_path / f"h{k}.err").read_text() for k in range(2))


def _srun_task(h, tmp_path, args: list[str], job: int, k: int, n: int = 3) -> subprocess.Popen:
    """Task k of an srun-style step of `n` tasks, one per host (SLURM's variables as srun sets
    them on host k; task 0 hosts the store): psrpc with `args`, its log appended to h<k>.err.
    Starting it again with the same environment is what an engine that restarts one rank at a
    time does (Kubernetes' restartPolicy: OnFailure)."""
    with open(tmp_path / f"h{k}.err", "a") as err:
        return h.popen(k, [sys.executable, "-m", "psrpc", *args, "cluster.interface=eth1"],
                       cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=err, env={
            **_env(), "SLURM_JOB_ID": str(job), "SLURM_STEP_ID": "0", "SLURM_PROCID": str(k),
            "SLURM_LOCALID": "0", "SLURM_NODEID": str(k), "SLURM_NTASKS": str(n),
            "SLURM_TASKS_PER_NODE": f"1(x{n})", "SLURM_NODELIST": f"h[0-{n - 1}]",
            "SLURM_STEP_NODELIST": f"h[0-{n - 1}]"})


def _assert_counts_agree(summary: dict, traffic: list[dict]) -> None:
    """The summary's bytes between hosts (each rank's TCP connections, as its kernel counted
    them) agree within 10 % with what each host's interface counted (headers and ACKs
    included: a few percent more)."""
    pairs = summary["host_traffic"]["bytes"]
    for k, seen in enumerate(traffic):
        sent = sum(v["total"] for p, v in pairs.items()
                   if p.split(" -> ")[0] == f"h{k}" != p.split(" -> ")[1])
        got = sum(v["total"] for p, v in pairs.items()
                  if p.split(" -> ")[1] == f"h{k}" != p.split(" -> ")[0])
        assert abs(seen["tx_bytes"] - sent) <= 0.1 * seen["tx_bytes"], (k, seen, pairs)
        assert abs(seen["rx_bytes"] - got) <= 0.1 * seen["rx_bytes"], (k, seen, pairs)


@pytest.fixture
def nothing_left():
    """Nothing of the test's own emulation is left (another run's, on the same machine, may be
    there before and after: it is not this test's to remove)."""
    before = set(hosts.leftovers()) | {f"pid {p.pid}" for p in _holders()}
    yield
    left = [x for x in hosts.leftovers() + [f"pid {p.pid}" for p in _holders()]
            if x not in before]
    hosts.sweep(only=left)
    assert not left, f"left behind: {left}"


def test_each_host_is_a_machine_of_its_own(nothing_left, tmp_path):
    disk = str(tmp_path / "disk")
    with hosts.Hosts(2, rate_mbit=200, disk=disk) as h:
        seen = [h.run(k, ["sh", "-c", "hostname; ip -o -4 addr show eth1; ps -e -o pid= | wc -l; "
                                      f"touch /dev/shm/mine {disk}/mine; ls /dev/shm"])
                for k in range(2)]
        for k, r in enumerate(seen):
            name, addr, procs, shm = r.stdout.split("\n")[:4]
            assert name == f"h{k}" and f"{h.addr(k)}/24" in addr
            assert int(procs) <= 4  # its PID 1, the shell and ps: no process of the machine's
            assert shm == "mine"  # one file: its own /dev/shm, not the other host's
        assert [p.name for p in h.disk(0).iterdir()] == ["mine"] and not os.listdir(disk)
        assert "rate 200Mbit" in h.run(0, ["tc", "qdisc", "show", "dev", "eth1"]).stdout
        h.set_rate(1, 50)
        assert "rate 50Mbit" in h.run(1, ["tc", "qdisc", "show", "dev", "eth1"]).stdout

        server = h.popen(0, SERVE, stdout=subprocess.PIPE, text=True)
        assert server.stdout.readline().strip() == "up"
        assert h.run(1, CONNECT).stdout.strip() == "hi"  # by name, through /etc/hosts
        before = h.counters(1)
        h.partition(1)
        cut = h.run(1, CONNECT)
        assert cut.returncode != 0 and "timed out" in cut.stderr  # silence, not a refusal
        h.heal(1)
        assert h.run(1, CONNECT).stdout.strip() == "hi"
        assert h.counters(1)["tx_bytes"] > before["tx_bytes"]

        h.power_off(0)  # every process of host 0 at once
        assert server.wait(timeout=10) != 0
        h.power_on(0)
        assert h.run(0, ["ls", "/dev/shm"]).stdout == ""  # a fresh boot: an empty /dev/shm
        assert [p.name for p in h.disk(0).iterdir()] == ["mine"]  # its disk kept


def test_an_error_or_ctrl_c_inside_tears_everything_down(nothing_left):
    for exc in (RuntimeError("a test failed"), KeyboardInterrupt()):
        with pytest.raises(type(exc)):
            with hosts.Hosts(2) as h:
                h.popen(1, ["sleep", "60"])
                raise exc
        assert not [x for x in hosts.leftovers() if x.split()[1].startswith(
            hosts.PREFIX + h.id)] and not [p for p in _holders() if h.id in " ".join(p.cmdline())]


def test_a_host_name_that_resolves_to_loopback_stops_the_start_naming_the_key(nothing_left,
                                                                              tmp_path):
    """Two hosts whose own names resolve to 127.0.1.1 (stock Debian and Ubuntu), torchrun on
    each, no cluster.interface: RPC would listen where the other host cannot reach it. Each
    rank stops at once with one line naming cluster.interface, long before the rendezvous
    timeout it would otherwise run into (cluster.init_timeout_s, 120 s by default)."""
    args = on_cpu(["train.steps=20", "cluster.num_workers=1"])
    with hosts.Hosts(2, own_name_loopback=True) as h:
        assert h.run(0, [sys.executable, "-c", "import socket; print(socket.gethostbyname("
                                               "socket.gethostname()))"]).stdout.strip() == \
            "127.0.1.1"
        started = time.monotonic()
        codes = _wait(_agents(h, tmp_path, args, "preflight", procs=(1, 1)), timeout_s=90)
        took = time.monotonic() - started
    logs = "".join((tmp_path / f"h{k}.err").read_text() for k in range(2))
    assert all(c not in (None, 0) for c in codes), (codes, logs)
    lines = [ln for ln in logs.splitlines() if ln.startswith("psrpc: error:")]
    assert lines and all("resolves to 127.0.1.1 (loopback)" in ln and "set cluster.interface"
                         in ln and "eth1 (198.18.0." in ln for ln in lines), logs
    assert took < 45, f"{took:.1f} s (torchrun's own start and rendezvous included)"


@pytest.mark.slow
def test_two_hosts_under_torchrun_equal_the_local_launcher(nothing_left, tmp_path):
    """Two emulated hosts, a torchrun agent on each (c10d rendezvous on h0, ranks on eth1), 1 PS
    and 4 workers: ps0 and worker0 share h0 (shared memory); worker1, worker2 and worker3 are on
    h1 (TCP through the bridge), where worker2 and worker3 fill an aligned block and push one
    sum (update.host_push=auto) while worker1 pushes its own. The model equals the local
    launcher's (every worker on one host, pushing its own) bit for bit."""
    args = on_cpu(["train.steps=20", "train.batch_size=16", "data.size=2048",
                   "data.test_size=256", "cluster.num_workers=4", "cluster.worker_threads=1"])
    local = cli(args + [f"out_dir={tmp_path / 'local'}"], tmp_path)
    assert local.returncode == 0, local.stderr
    with hosts.Hosts(2) as h:
        codes, logs = _torchrun(h, tmp_path, args, "hosts", procs=(2, 3))
        traffic = [h.counters(k) for k in range(2)]
    assert codes == [0, 0], logs
    assert "shared memory with the PS on the same host: 1 of 1 shards" in logs
    # two pushes a step crossed the bridge (worker1's, the block's), 1.08 MB each, where each
    # worker's own would be three
    assert 2 * 20 * 1.0e6 < traffic[1]["tx_bytes"] < 2.5 * 20 * 1.08e6
    a = torch.load(tmp_path / "local" / "model.pt", weights_only=True)
    b = torch.load(tmp_path / "outputs" / "torchrun" / "hosts" / "model.pt", weights_only=True)
    assert_equal_model(a, b)
    summary = json.loads((tmp_path / "outputs" / "torchrun" / "hosts" / "summary.json")
                         .read_text())
    assert summary["host_push"] == ["workers 2-3 push as one, led by worker2"]
    assert summary["shards"][0]["host_sums"] == 20
    assert summary["host_traffic"]["hosts"] == {"h0": ["worker0", "ps0"],
                                                "h1": ["worker1", "worker2", "worker3"]}
    assert summary["host_traffic"]["bytes"]["h1 -> h0"]["tensorpipe"] > 2 * 20 * 1.0e6
    _assert_counts_agree(summary, traffic)


@pytest.mark.slow
def test_spread_ps_placement_puts_a_ps_on_each_host_and_equals_the_local_launcher(
        nothing_left, tmp_path):
    """cluster.ps_placement=spread under torchrun on two hosts, 2 PS and 2 workers: the first
    rank of each host is a PS (ps0 with worker0 on h0, ps1 with worker1 on h1), so each host's
    link carries half the shards' pushes one way and half the other. The model equals the local
    launcher's bit for bit."""
    args = on_cpu(["train.steps=20", "train.batch_size=16", "data.size=2048",
                   "data.test_size=256", "cluster.num_ps=2", "cluster.worker_threads=1"])
    local = cli(args + [f"out_dir={tmp_path / 'local'}"], tmp_path)
    assert local.returncode == 0, local.stderr
    with hosts.Hosts(2) as h:
        codes, logs = _torchrun(h, tmp_path, args + ["cluster.ps_placement=spread"], "spread")
        traffic = [h.counters(k) for k in range(2)]
    assert codes == [0, 0], logs
    there = tmp_path / "outputs" / "torchrun" / "spread"
    summary = json.loads((there / "summary.json").read_text())
    assert {h: sorted(names) for h, names in summary["host_traffic"]["hosts"].items()} == {
        "h0": ["ps0", "worker0"], "h1": ["ps1", "worker1"]}
    pairs = summary["host_traffic"]["bytes"]
    assert pairs["h0 -> h1"]["tensorpipe"] > 20 * 0.3e6 < pairs["h1 -> h0"]["tensorpipe"]
    assert_equal_model(torch.load(tmp_path / "local" / "model.pt", weights_only=True),
                       torch.load(there / "model.pt", weights_only=True))
    _assert_counts_agree(summary, traffic)


@pytest.mark.slow
def test_three_hosts_of_srun_style_tasks_equal_the_local_launcher(nothing_left, tmp_path):
    """One task per emulated host with the variables srun gives them (SLURM_NODELIST=h[0-2];
    task 0 on h0 hosts the store): ps0 on h0, worker0 on h1, worker1 on h2, every byte between
    them over TCP through the bridge. The model equals the local launcher's bit for bit."""
    from tests.test_multinode import _slurm_job_id

    args = on_cpu(["train.steps=20", "train.batch_size=16", "data.size=2048",
                   "data.test_size=256", "cluster.worker_threads=1"])
    local = cli(args + [f"out_dir={tmp_path / 'local'}"], tmp_path)
    assert local.returncode == 0, local.stderr
    job = _slurm_job_id()
    with hosts.Hosts(3) as h:
        tasks = [_srun_task(h, tmp_path, args, job, k) for k in range(3)]
        codes = _wait(tasks)
        traffic = [h.counters(k) for k in range(3)]
    logs = "".join((tmp_path / f"h{k}.err").read_text()[-3000:] for k in range(3))
    assert codes == [0, 0, 0], logs
    assert "shared memory with the PS" not in logs  # no worker shares ps0's host
    assert all(t["rx_bytes"] > 20 * 1.0e6 for t in traffic[1:])  # each worker's pulls
    a = torch.load(tmp_path / "local" / "model.pt", weights_only=True)
    b = torch.load(tmp_path / "outputs" / "slurm" / f"{job}.0" / "model.pt", weights_only=True)
    assert_equal_model(a, b)
    summary = json.loads((tmp_path / "outputs" / "slurm" / f"{job}.0" / "summary.json")
                         .read_text())
    assert summary["host_traffic"]["hosts"] == {"h1": ["worker0"], "h0": ["ps0"],
                                                "h2": ["worker1"]}
    _assert_counts_agree(summary, traffic)


@pytest.mark.slow
@pytest.mark.parametrize("key", ["checkpoint.dir", "out_dir"])
def test_a_folder_on_each_hosts_own_disk_is_refused_at_start(nothing_left, tmp_path, key):
    """Each host has its own disk at /<tmp>/disk; ps0 and ps1 on h0, the chief (worker0) and
    worker1 on h1. A checkpoint.dir there (every PS writes its shards; a restore reads all), or
    for a model with tables an out_dir there (every PS writes its rows for load_tables), would
    scatter files that belong together: the run stops at start with one line naming the key."""
    disk = str(tmp_path / "disk")
    args = on_cpu(["+experiment=clicks_dlrm", "train.steps=5", "cluster.num_ps=2",
                   "cluster.num_workers=2", "cluster.worker_threads=1",
                   f"{key}={disk}/there"])
    with hosts.Hosts(2, disk=disk) as h:
        codes, logs = _torchrun(h, tmp_path, args, "disks")
        written = [str(p) for k in range(2) for p in h.disk(k).rglob("*") if p.is_file()]
    assert None not in codes and codes != [0, 0], logs[-3000:]
    line = f"{key}={disk}/there is not the same folder on ps0, ps1 as on the chief"
    assert line in logs, logs[-3000:]
    # every psrpc rank says it in one line (torchrun's own report of a failed agent follows)
    assert "AttributeError" not in logs and "the chief could not start the run" in logs
    assert not [p for p in written if "step-" in p or p.endswith(".pt")], written


def _chief_step(path) -> int:
    """The chief's last logged step (its progress lines in the agent's log)."""
    steps = re.findall(r"\[worker0\] step +(\d+)/", path.read_text())
    return int(steps[-1]) if steps else 0


@pytest.mark.slow
@pytest.mark.parametrize("cut_s", [1.0, 6.0], ids=["shorter-than-timeout", "longer-than-rpc-timeout"])
def test_a_worker_host_cut_off_trains_again_after_the_heal(nothing_left, tmp_path, cut_s):
    """torchrun on two hosts, sync: ps0 and the chief on h0, worker1 and worker2 on h1. h1 is
    cut off at step 40 for `cut_s`, then healed; its ranks are alive all along. Shorter than
    update.timeout_s (2 s), TCP carries the pushes on after the heal. Longer than
    cluster.rpc_timeout_s (4 s), their calls fail: as soon as the store answers again they
    announce a membership epoch and everybody joins it (no restart, no checkpoint). Either
    way: h0 trained on during the cut without waiting past update.timeout_s for a round, h1's
    workers pushed again after the heal, both agents end with 0."""
    # long enough that the chief, alone during the cut, does not finish before the heal
    args = on_cpu(["train.steps=3000", "train.batch_size=16", "data.size=2048",
                   "data.test_size=256", "cluster.num_workers=3", "cluster.worker_threads=1",
                   "update.timeout_s=2", "cluster.rpc_timeout_s=4", "train.log_every=10",
                   "cluster.interface=eth1"])
    with hosts.Hosts(2) as h:
        agents = _agents(h, tmp_path, args, "cut")
        deadline = time.monotonic() + 120
        while _chief_step(tmp_path / "h0.err") < 40 and time.monotonic() < deadline:
            time.sleep(0.1)
        at_cut = _chief_step(tmp_path / "h0.err")
        h.partition(1)
        time.sleep(cut_s)
        at_heal = _chief_step(tmp_path / "h0.err")
        h.heal(1)
        codes = _wait(agents, 150)
    logs = "".join((tmp_path / f"h{k}.err").read_text() for k in range(2))
    assert codes == [0, 0], logs[-4000:]
    summary = json.loads((tmp_path / "outputs" / "torchrun" / "cut" / "summary.json").read_text())
    assert summary["restored_from_step"] is None and "Restarting" not in logs
    applied = summary["shards"][0]["per_worker_applied"]
    for w in ("1", "2"):  # each pushed again after the heal (it had pushed about 40 before)
        assert applied[w] >= at_cut + 50, (applied, at_cut)
    # nothing h1 computed before or during the cut changed a newer round (sync: a late push is
    # refused; an old epoch's group cannot reach the new one's)
    assert summary["shards"][0]["max_staleness"] == 0, summary["shards"][0]
    # no round waited past update.timeout_s (its watchdog looks every 0.1 s; 2 busy cores)
    waits = [float(s) for s in re.findall(r"waited ([\d.]+) s \(update.timeout_s=2\)", logs)]
    assert all(s < 2.5 for s in waits), waits
    if cut_s > 4:
        assert waits, "no round went on without h1's workers"
        assert at_heal - at_cut >= 20, (at_cut, at_heal)  # h0 trained on during the cut
        (epoch,) = summary["epochs"]  # one epoch, formed after the heal
        assert epoch["rolled_back_to"] is None and epoch["pause_s"] < 2.0, epoch
        assert epoch["cut_off"] and set(epoch["cut_off"]) <= {"worker1", "worker2"}, epoch
    else:
        assert summary["epochs"] == [], summary["epochs"]


@pytest.mark.slow
def test_a_slow_link_makes_its_workers_stragglers_not_the_cluster(nothing_left, tmp_path):
    """torchrun on two hosts, sync: ps0 and the chief on h0, worker1 and worker2 on h1. At step
    40 h1's link drops to 2 Mbit/s each way (a 1.08 MB push takes over 4 s): a straggler by
    network. Rounds go on without h1's workers after update.timeout_s and never wait longer
    (the chief trains on alone meanwhile); their pushes that come late are refused as stale,
    not applied to a newer round. After 4 s the link is fast again and h1's workers push in
    the rounds again; both agents end with 0. A slow push is no lost call (the RPC timeout,
    10 s, is past a push at 2 Mbit/s); but a TCP connection whose retransmission timer backed
    off while tbf dropped its packets can stay silent for many seconds after the link is fast
    again (two runs in three here): past the RPC timeout its call fails and the worker rejoins
    in a membership epoch, as a rank cut off does (no restart, no checkpoint)."""
    # The chief sleeps 20 ms a step: alone it would otherwise run ten times as fast as the
    # three together and could end the run before TCP, backing off during the slow link,
    # brings h1's workers back (seconds)
    # Every step logged: the chief's progress during the 4 s is read to the step (a round
    # there may wait update.timeout_s twice: a late push from h1, stale, shows its workers
    # alive, and the next round waits for them again)
    args = on_cpu(["train.steps=1500", "cluster.num_workers=3", "cluster.interface=eth1",
                   "fault.slow_worker=0", "fault.slow_s=0.02", "cluster.rpc_timeout_s=10",
                   *[a for a in LOSS_ARGS if not a.startswith(("cluster.rpc_timeout_s",
                                                               "train.log_every"))],
                   "train.log_every=1"])
    with hosts.Hosts(2) as h:
        agents = _agents(h, tmp_path, args, "slow")
        at_slow = _wait_for_step(tmp_path / "h0.err", 40)
        h.set_rate(1, 2)
        time.sleep(4)
        h.set_rate(1, None)
        at_fast = _chief_step(tmp_path / "h0.err")
        codes = _wait(agents, 150)
    logs = "".join((tmp_path / f"h{k}.err").read_text() for k in range(2))
    assert codes == [0, 0], logs[-4000:]
    summary = json.loads((tmp_path / "outputs" / "torchrun" / "slow" / "summary.json")
                         .read_text())
    assert summary["restored_from_step"] is None and "Restarting" not in logs
    for epoch in summary["epochs"]:  # a stalled connection's worker, rejoining
        assert epoch["rolled_back_to"] is None and epoch["at_step"] > at_fast, epoch
        assert set(epoch["cut_off"]) <= {"worker1", "worker2"}, epoch
    assert summary["steps"] == 1500 and at_fast < 1500 - 500, (summary["steps"], at_fast)
    waits = [float(s) for s in re.findall(r"waited ([\d.]+) s \(update.timeout_s=2\)", logs)]
    assert waits and all(s < 2.5 for s in waits), waits  # stragglers, never waited for longer
    assert at_fast - at_slow >= 1, (at_slow, at_fast)  # h0 trained on while the link was slow
    shard = summary["shards"][0]
    applied = shard["per_worker_applied"]
    for w in ("1", "2"):  # pushing in the rounds again once the link was fast
        assert applied[w] >= at_fast + 100, (applied, at_fast, summary["epochs"], logs[-3000:])
    # their pushes that came late were refused, not applied to a newer round
    assert shard["max_staleness"] == 0 and sum(shard["per_worker_stale"].values()) >= 1, shard


def _wait_for_step(path, step: int, timeout_s: float = 120) -> int:
    deadline = time.monotonic() + timeout_s
    while _chief_step(path) < step and time.monotonic() < deadline:
        time.sleep(0.1)
    return _chief_step(path)


LOSS_ARGS = ["train.batch_size=16", "data.size=2048", "data.test_size=256",
             "cluster.worker_threads=1", "update.timeout_s=2", "cluster.rpc_timeout_s=4",
             "train.log_every=10"]


@pytest.mark.slow
def test_a_worker_host_lost_and_its_rank_started_again_rejoins_the_live_run(nothing_left,
                                                                             tmp_path):
    """srun-style tasks on three hosts, sync: ps0 on h0, the chief on h1, worker1 on h2. h2
    loses power at step 40 (every process of it killed at once); then, as an engine that
    restarts one rank at a time does (Kubernetes' restartPolicy: OnFailure), worker1 is started
    again with the same environment on the rebooted host. It finds its earlier life in the
    store, announces a membership epoch and rejoins the live run: no checkpoint restored, the
    PS kept everything, the chief went on alone meanwhile without waiting past
    update.timeout_s for a round, and every task that lived ends with 0."""
    from tests.test_multinode import _slurm_job_id

    args = on_cpu(["train.steps=1500", *LOSS_ARGS])
    job = _slurm_job_id()
    with hosts.Hosts(3) as h:
        tasks = [_srun_task(h, tmp_path, args, job, k) for k in range(3)]
        at_loss = _wait_for_step(tmp_path / "h1.err", 40)
        h.power_off(2)
        lost_at = time.monotonic()
        time.sleep(2)
        h.power_on(2)
        again = _srun_task(h, tmp_path, args, job, 2)
        codes = _wait(tasks[:2] + [again], 200)
        ended_s = time.monotonic() - lost_at
    logs = "".join((tmp_path / f"h{k}.err").read_text() for k in range(3))
    assert codes == [0, 0, 0], logs[-5000:]
    summary = json.loads((tmp_path / "outputs" / "slurm" / f"{job}.0" / "summary.json")
                         .read_text())
    assert summary["restored_from_step"] is None, summary["restored_from_step"]
    (epoch,) = summary["epochs"]
    assert epoch["started_again"] == "worker1" and epoch["rolled_back_to"] is None, epoch
    assert epoch["at_step"] > at_loss, (epoch, at_loss)
    applied = summary["shards"][0]["per_worker_applied"]
    assert applied["1"] >= at_loss + 100, (applied, at_loss)  # it trained again after
    waits = [float(s) for s in re.findall(r"waited ([\d.]+) s \(update.timeout_s=2\)", logs)]
    assert waits and all(s < 2.5 for s in waits), waits
    assert "started again into the running job" in logs
    assert ended_s < 150, ended_s


@pytest.mark.slow
def test_a_worker_host_lost_under_torchrun_leaves_the_others_training(nothing_left, tmp_path):
    """torchrun on two hosts, sync: ps0 and the chief on h0, worker1 and worker2 on h1. h1
    loses power at step 40 (its agent with it: torchrun has nobody to restart it, and the
    surviving agent sees no failure of its own). The chief trains on alone (no round waits past
    update.timeout_s), ends training and writes its outputs; h0's psrpc ranks end with 0.
    torchrun's agent on h0 then waits in its exit barrier for the lost agent (300 s, torch's
    `exit_barrier_timeout`, not a torchrun flag): the test stops it there."""
    args = on_cpu(["train.steps=600", "cluster.num_workers=3", *LOSS_ARGS,
                   "cluster.interface=eth1"])
    with hosts.Hosts(2) as h:
        agents = _agents(h, tmp_path, args, "lost")
        at_loss = _wait_for_step(tmp_path / "h0.err", 40)
        h.power_off(1)
        lost_at = time.monotonic()
        summary_path = tmp_path / "outputs" / "torchrun" / "lost" / "summary.json"
        ranks = []
        deadline = lost_at + 150
        while time.monotonic() < deadline:
            ranks = [p for p in psutil.Process(agents[0].pid).children(recursive=True)
                     if p.name().startswith("psrpc-")]
            if summary_path.exists() and not ranks:
                break
            time.sleep(0.5)
        ended_s = time.monotonic() - lost_at
        barrier = agents[0].poll() is None  # its ranks are gone, it waits for the lost agent
    logs = (tmp_path / "h0.err").read_text()
    assert not ranks and summary_path.exists(), logs[-5000:]
    assert ended_s < 120, ended_s
    summary = json.loads(summary_path.read_text())
    assert summary["steps"] == 600 and summary["restored_from_step"] is None, summary
    assert summary["workers_lost"] == 2, summary["workers_lost"]
    waits = [float(s) for s in re.findall(r"waited ([\d.]+) s \(update.timeout_s=2\)", logs)]
    assert waits and all(s < 2.5 for s in waits), waits
    assert "exitcode" not in logs  # no rank of h0 failed (torchrun names failed ranks so)
    assert barrier, logs[-3000:]


def _ps1_host_lost(tmp_path, args: list[str], restart: bool, wait_s: float) -> tuple:
    """srun-style tasks on four hosts: ps0 (and the store) on h0, ps1 on h1, the chief on h2,
    worker1 on h3. h1 loses power at step 50; with `restart`, ps1 is started again with the
    same environment on the rebooted host 2 s later, as an engine that restarts one rank at a
    time does. (The exit codes of the tasks that lived, seconds from the loss until they
    ended, the job id, the step of the loss.)"""
    from tests.test_multinode import _slurm_job_id

    job = _slurm_job_id()
    with hosts.Hosts(4) as h:
        tasks = [_srun_task(h, tmp_path, args, job, k, n=4) for k in range(4)]
        at_loss = _wait_for_step(tmp_path / "h2.err", 50)
        h.power_off(1)
        lost_at = time.monotonic()
        if restart:
            time.sleep(2)
            h.power_on(1)
            tasks[1] = _srun_task(h, tmp_path, args, job, 1, n=4)
        codes = _wait(tasks if restart else [tasks[0], *tasks[2:]], wait_s)
        ended_s = time.monotonic() - lost_at
    return codes, ended_s, job, at_loss


@pytest.mark.slow
def test_a_ps_host_lost_and_its_rank_started_again_rolls_every_shard_back(nothing_left,
                                                                         tmp_path):
    """srun-style tasks on four hosts, sync, checkpoints every 20 steps: ps0 (and the store) on
    h0, ps1 on h1, the chief on h2, worker1 on h3. h1 loses power at step 50; ps1 is started
    again with the same environment on the rebooted host, as an engine that restarts one rank
    at a time does. Its shards are gone with its memory, so, as under the local launcher, every
    shard rolls back to the last committed checkpoint (step-consistent) and training goes on in
    the live run: nobody else restarts, and the run ends with 0 everywhere."""
    args = on_cpu(["train.steps=400", "cluster.num_ps=2", "cluster.num_workers=2", *LOSS_ARGS,
                   f"checkpoint.dir={tmp_path / 'ckpt'}", "checkpoint.every_steps=20"])
    codes, ended_s, job, at_loss = _ps1_host_lost(tmp_path, args, restart=True, wait_s=200)
    logs = "".join((tmp_path / f"h{k}.err").read_text() for k in range(4))
    assert codes == [0, 0, 0, 0], logs[-5000:]
    summary = json.loads((tmp_path / "outputs" / "slurm" / f"{job}.0" / "summary.json")
                         .read_text())
    (epoch,) = summary["epochs"]
    # ps1 started again; a worker whose push to the lost ps1 failed asked for the epoch first
    # (it cannot tell a lost peer from a partition) and is named with it
    assert "ps1" in epoch["started_again"].split(","), epoch
    assert set(epoch["cut_off"]) <= {"worker0", "worker1"}, epoch
    assert epoch["rolled_back_to"] is not None and epoch["rolled_back_to"] <= at_loss + 20, epoch
    assert epoch["rolled_back_to"] % 20 == 0, epoch
    assert summary["steps"] == 400 and summary["restored_from_step"] is None, summary
    assert ended_s < 150, ended_s


@pytest.mark.slow
def test_a_ps_host_lost_with_replicas_fails_over_and_equals_the_local_launcher(nothing_left,
                                                                                tmp_path):
    """The same four hosts with cluster.ps_replicas=1 and no checkpoint.dir at all: ps1's
    shards have their backups on ps0 (another host). h1 loses power at step 50 and ps1 is
    started again on the rebooted host: ps1's shards fail over to ps0 in the membership epoch,
    nothing is rolled back, ps1 becomes their backup again, and the model is bit for bit the
    local launcher's uninterrupted run."""
    args = on_cpu(["train.steps=400", "cluster.num_ps=2", "cluster.num_workers=2", *LOSS_ARGS,
                   "cluster.ps_replicas=1"])
    codes, _, job, _ = _ps1_host_lost(tmp_path, args, restart=True, wait_s=200)
    logs = "".join((tmp_path / f"h{k}.err").read_text() for k in range(4))
    assert codes == [0, 0, 0, 0], logs[-5000:]
    out = tmp_path / "outputs" / "slurm" / f"{job}.0"
    summary = json.loads((out / "summary.json").read_text())
    epoch = summary["epochs"][-1]
    assert all(e["rolled_back_to"] is None for e in summary["epochs"]), summary["epochs"]
    assert "ps1" in epoch["started_again"].split(","), epoch
    moved = [f for e in summary["epochs"] for f in e["failovers"]]
    assert moved and all(f["from"] == "ps1" and f["to"] == "ps0" for f in moved), moved
    assert summary["steps"] == 400 and summary["restored_from_step"] is None, summary
    assert summary["replicas"]["agree"], summary["replicas"]
    local = cli(args + [f"out_dir={tmp_path / 'local'}"], tmp_path)
    assert local.returncode == 0, local.stderr
    assert_equal_model(torch.load(tmp_path / "local" / "model.pt", weights_only=True),
                       torch.load(out / "model.pt", weights_only=True))


@pytest.mark.slow
def test_a_ps_host_lost_and_not_started_again_stops_the_run_naming_it(nothing_left, tmp_path):
    """The same four hosts, ps1's host lost at step 50 and nobody starting it again (plain
    srun): the ranks left ask for an epoch, wait cluster.init_timeout_s (20 s) for ps1 at its
    gathering, and each stops with one line naming ps1. Nothing hangs, nothing trains on with a
    shard missing."""
    args = on_cpu(["train.steps=1500", "cluster.num_ps=2", "cluster.num_workers=2", *LOSS_ARGS,
                   "cluster.init_timeout_s=20"])
    codes, ended_s, _, _ = _ps1_host_lost(tmp_path, args, restart=False, wait_s=150)
    assert all(c not in (None, 0) for c in codes), codes
    assert ended_s < 20 + 60, ended_s
    for k in (0, 2, 3):
        log = (tmp_path / f"h{k}.err").read_text()
        last = [x for x in log.splitlines() if x.startswith("psrpc: error:")]
        assert len(last) == 1 and "ps1" in last[0], log[-3000:]
        assert "Traceback" not in log, log[-3000:]


@pytest.mark.slow
def test_the_chiefs_host_lost_stops_the_run_naming_it(nothing_left, tmp_path):
    """srun-style tasks on three hosts, sync: ps0 (and the store) on h0, the chief on h1,
    worker1 on h2. h1 loses power at step 40. As TensorFlow's MonitoredTrainingSession, the
    chief's session (hooks, metrics, saver) is gone with it: the others stop within a bound,
    each with one line naming the chief, and the chief started again with the same environment
    12 s later refuses with one line saying how to resume (start the job again: it restores the last
    checkpoint). Nothing hangs."""
    from tests.test_multinode import _slurm_job_id

    args = on_cpu(["train.steps=1500", *LOSS_ARGS])
    job = _slurm_job_id()
    with hosts.Hosts(3) as h:
        tasks = [_srun_task(h, tmp_path, args, job, k) for k in range(3)]
        _wait_for_step(tmp_path / "h1.err", 40)
        h.power_off(1)
        lost_at = time.monotonic()
        # the chief comes back after the others saw it gone (ps0 pings it every 5 s), and a
        # start on a busy host takes seconds more: they wait for its word, not a fixed grace
        time.sleep(12)
        h.power_on(1)
        again = _srun_task(h, tmp_path, args, job, 1)
        codes = _wait([tasks[0], again, tasks[2]], 150)
        ended_s = time.monotonic() - lost_at
    logs = [(tmp_path / f"h{k}.err").read_text() for k in range(3)]
    assert None not in codes and 0 not in codes, (codes, "".join(logs)[-5000:])
    assert ended_s < 60, ended_s
    assert "worker0 (the chief) was started again while the other ranks of the run live" \
        in logs[1], logs[1][-3000:]
    for k in (0, 2):
        last = [x for x in logs[k].splitlines() if x.startswith("psrpc: error:")]
        assert last and "the chief (worker0) was lost and started again" in last[-1], logs[k]
        assert "Traceback" not in logs[k], logs[k][-3000:]


@pytest.mark.slow
def test_the_rendezvous_host_lost_stops_the_run_naming_the_store(nothing_left, tmp_path):
    """srun-style tasks on three hosts: task 0 (ps0) hosts the rendezvous store on h0, which
    loses power at step 40 and stays down. The others cannot tell a lost host from a partition:
    they try the store for cluster.init_timeout_s (20 s here), then stop with one line naming
    it. Nothing hangs."""
    from tests.test_multinode import _slurm_job_id

    args = on_cpu(["train.steps=1500", *LOSS_ARGS, "cluster.init_timeout_s=20"])
    job = _slurm_job_id()
    with hosts.Hosts(3) as h:
        tasks = [_srun_task(h, tmp_path, args, job, k) for k in range(3)]
        _wait_for_step(tmp_path / "h1.err", 40)
        h.power_off(0)
        lost_at = time.monotonic()
        codes = _wait(tasks[1:], 120)
        ended_s = time.monotonic() - lost_at
    logs = [(tmp_path / f"h{k}.err").read_text() for k in range(3)]
    assert codes == [2, 2], (codes, "".join(logs)[-5000:])
    assert ended_s < 20 + 30, ended_s
    for k in (1, 2):
        last = [x for x in logs[k].splitlines() if x.startswith("psrpc: error:")]
        assert last and "store" in last[-1], logs[k][-3000:]
        assert "Traceback" not in logs[k], logs[k][-3000:]


@pytest.mark.slow
def test_the_first_host_lost_under_torchrun_ends_the_other_with_one_line(nothing_left,
                                                                        tmp_path):
    """torchrun on two hosts: h0 holds ps0, the chief and the rendezvous (c10d and the ranks'
    store, on its agent); h1 holds worker1 and worker2. h0 loses power at step 40. h1's agent
    loses its rendezvous at once and stops its ranks (torchrun cannot restart a group whose
    rendezvous is gone, and says so in its own traceback); each of h1's ranks ends with one line
    naming what it lost (ps0, or the store when it asked that first); h1's agent ends non-zero
    within a bound. Nothing hangs."""
    args = on_cpu(["train.steps=1500", "cluster.num_workers=3", *LOSS_ARGS,
                   "cluster.init_timeout_s=20", "cluster.interface=eth1"])
    with hosts.Hosts(2) as h:
        agents = _agents(h, tmp_path, args, "first")
        _wait_for_step(tmp_path / "h0.err", 40)
        h.power_off(0)
        lost_at = time.monotonic()
        (code,) = _wait(agents[1:], 150)
        ended_s = time.monotonic() - lost_at
    logs = (tmp_path / "h1.err").read_text()
    assert code not in (None, 0), (code, logs[-5000:])
    assert ended_s < 20 + 60, ended_s
    lines = [x for x in logs.splitlines() if x.startswith("psrpc: error:")]
    assert len(lines) == 2, logs[-5000:]
    assert all(re.search(r"ps0|the rendezvous store", x) for x in lines), lines
    frames = [x for x in logs.splitlines() if x.strip().startswith('File "')]
    assert not [x for x in frames if "psrpc" in x], frames  # the ranks: one line, no traceback


W3 = ["cluster.num_workers=3"]  # ps0 and worker0 on h0, worker1 and worker2 on h1
W2 = ["cluster.num_workers=2"]  # ps0 and worker0 on h0, worker1 on h1
ALLREDUCE = ["update.dense=allreduce", "sparse.cache_rows=200", "sparse.cache_staleness=0"]
TABLE_RUNS = {
    "fixed": W3,
    "dynamic": W3 + ["sparse.dynamic=true", "sparse.admit_after=2"],
    "allreduce-cache-2-workers": W2 + ALLREDUCE,
    "allreduce-cache-3-workers": W3 + ALLREDUCE,
}
# Where the order of sums differs: the local launcher's three workers add their dense buckets in
# rank order over Unix sockets, ((g0 + g1) + g2); across hosts gloo's ring adds each chunk
# starting at a different rank. Measured after 20 steps: 4.7e-10 at most on weights of 0.1-0.5
# (a few float32 ulps); the bound leaves 200x room and is far below any real divergence.
ORDER_DIFFERS = {"allreduce-cache-3-workers": 1e-7}


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(TABLE_RUNS))
def test_tables_over_two_hosts_under_torchrun_equal_the_local_launcher(nothing_left, tmp_path,
                                                                      kind):
    """DLRM on click logs, sync, over two hosts under torchrun: fixed and dynamic tables with
    dense on the PS, and dense all-reduce with the hot-row cache at staleness 0 with two
    workers, equal the local launcher's bit for bit: model.pt and every table's rows (and ids).
    Two workers add a + b = b + a whichever transport adds them. With three workers the
    all-reduce's order of sums differs (ORDER_DIFFERS says why and by how much)."""
    from psrpc.sparse import load_tables
    from tests.test_sparse_cluster import CLICKS

    args = on_cpu(CLICKS + TABLE_RUNS[kind] + ["train.batch_size=16", "cluster.worker_threads=1"])
    local = cli(args + [f"out_dir={tmp_path / 'local'}"], tmp_path)
    assert local.returncode == 0, local.stderr[-3000:]
    with hosts.Hosts(2) as h:
        codes, logs = _torchrun(h, tmp_path, args, kind, procs=(2, 1) if W2[0] in args else (2, 2))
    assert codes == [0, 0], logs[-5000:]
    there = tmp_path / "outputs" / "torchrun" / kind
    summary = json.loads((there / "summary.json").read_text())
    assert summary["host_traffic"]["hosts"]["h1"] == ["worker1"] + ["worker2"] * (W3[0] in args)
    if "allreduce" in kind:  # across hosts: gloo's process group, not the one-host sockets
        assert summary["dense_group"] == "gloo", summary["dense_group"]
    a_model = torch.load(tmp_path / "local" / "model.pt", weights_only=True)
    b_model = torch.load(there / "model.pt", weights_only=True)
    a, b = load_tables(tmp_path / "local"), load_tables(there)
    assert a.keys() == b.keys()
    pairs = [(k, a_model[k], b_model[k]) for k in a_model] + [
        (f"{name}.{field}", getattr(a[name], field), getattr(b[name], field))
        for name in a for field in ("ids", "weight") if hasattr(a[name], field)]
    assert a_model.keys() == b_model.keys()
    bound = ORDER_DIFFERS.get(kind, 0.0)
    for key, x, y in pairs:
        diff = (x.double() - y.double()).abs().max().item() if x.numel() else 0.0
        assert diff <= bound and (bound or torch.equal(x, y)), (key, diff, bound)
    if bound:  # the difference is rounding, not nothing: the layouts really sum differently
        assert any(not torch.equal(x, y) for _, x, y in pairs)
