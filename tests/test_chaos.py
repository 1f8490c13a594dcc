"""The fault campaign's quick subset: a few seeded schedules of benchmarks/chaos.py (the whole
campaign, 100 schedules, is `python -m benchmarks.chaos`), each checked for every invariant:
it ends within its bound, finishes when it can (or names the cause), leaves no process and no
/dev/shm segment, and its newest committed checkpoint loads; and its fault was delivered. And
the harness's own honesty, on stand-in runs: a fault that reached nobody is reported as not
delivered and counted as no pass; the final evaluation's kill picks a rank that is running."""

import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from benchmarks import chaos, hosts

pytestmark = pytest.mark.timeout(400)


def _first(fault):
    return 0, list(chaos.FAULTS).index(fault)  # the first len(FAULTS) schedules: one of each


@pytest.mark.parametrize("fault,seed,index", [
    ("kill_two", *_first("kill_two")), ("kill_rejoining", *_first("kill_rejoining")),
    # async-bounded: the chief's last logged step is short of train.steps (the others took
    # the last ones), so the old harness waited for the run's end and killed nobody
    ("kill_in_eval", 7, 8),
    ("truncated_checkpoint", *_first("truncated_checkpoint")),
    ("kill_launcher", *_first("kill_launcher"))])
def test_a_seeded_schedule_keeps_every_invariant(fault, seed, index):
    _replay(fault, seed, index)


@pytest.mark.slow
@pytest.mark.skipif(hosts.missing() is not None, reason=str(hosts.missing()))
@pytest.mark.parametrize("fault,seed,index", [
    # the chief ended training during the cut; worker1 asked the store once healed, and found
    # task 0 gone (it now waits for every rank's word before it leaves)
    ("host_cut_long", 0, 15),
    # worker2 started again after the run ended found no store: a traceback wall, exit 1
    ("host_lost_worker_restarted", 0, 18)])
def test_a_seeded_host_fault_schedule_keeps_every_invariant(fault, seed, index):
    """Host faults over emulated hosts, one srun-style task a host (benchmarks/chaos_hosts.py)."""
    _replay(fault, seed, index)


def _replay(fault, seed, index):
    s = chaos.schedule(seed=seed, index=index)
    assert s["fault"] == fault
    with tempfile.TemporaryDirectory(prefix="psrpc-chaos-") as tmp:
        row = chaos.run_schedule(s, Path(tmp), steps=120, bound_s=150)
    assert row["outcome"] != "not delivered", row["did"]
    assert row["ok"], f"schedule {index} of seed {seed} ({row['did']}): {row['problems']}"
    if row["could_finish"]:
        assert row["outcome"] == "finished" and row["steps"] == 120


class _EndedRun(chaos.Run):
    """A stand-in for `python -m psrpc` that writes its summary and exits at once: a run that
    is over before its fault's moment comes."""

    def __init__(self, folder, overrides, steps):
        self.folder, self.steps = folder, steps
        self.out, self.ck = folder / "out", folder / "ck"
        folder.mkdir(parents=True, exist_ok=True)
        self.stderr_path = folder / "stderr.txt"
        self.stderr_path.write_text("")
        self.out.mkdir()
        script = (f"import json; open({str(self.out / 'summary.json')!r}, 'w')"
                  f".write(json.dumps({{'steps': {steps}}}))")
        self.proc = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
        self.sid = self.proc.pid
        self.started = time.monotonic()


def test_a_fault_that_reached_nobody_is_not_delivered_and_no_pass(tmp_path, monkeypatch):
    """kill_worker on a run that ended before its step came: its SIGKILL reaches no one. The
    run finished and kept every invariant, yet the schedule tested nothing: "not delivered",
    not ok, and the summary, the table and the verdict count it so, not among the passes."""
    monkeypatch.setattr(chaos, "Run", _EndedRun)
    s = chaos.schedule(seed=0, index=list(chaos.FAULTS).index("kill_worker"))
    row = chaos.run_schedule(s, tmp_path / "runs", steps=120, bound_s=30)
    assert row["outcome"] == "not delivered", row
    assert "not delivered" in row["did"] and row["ended"] == "finished"
    assert not row["ok"] and row["problems"] == ""
    line = chaos.summarize([row])[0]
    assert (line["passed"], line["finished"], line["not_delivered"], line["violations"]) == \
        (0, 0, 1, 0)
    verdict = chaos.report([row], seed=0, total_s=30)
    assert "0 passed" in verdict and f"were not delivered (no pass: they tested nothing) " \
        f"(replay: only=[{s['index']}])" in verdict
    meta = {"command": "c", "commit": "x", "date": "d",
            "machine": {"cpu": "c", "cores": 2, "torch": "t", "python": "p"}}
    chaos.write_results(tmp_path / "out", {**meta, "schedules": [row]}, [line], list(line),
                        "t", notes=verdict)
    table = (tmp_path / "out" / "results.md").read_text()
    assert "| not_delivered |" in table and "| passed |" in table
    got = json.loads((tmp_path / "out" / "results.json").read_text())["schedules"][0]
    assert got["outcome"] == "not delivered"


_TREE = """
import subprocess, sys, time
def rank(name, code):
    return subprocess.Popen([sys.executable, "-c",
                             f"open('/proc/self/comm', 'w').write({name!r}); {code}"])
keep = [rank("psrpc-ps0", "import time; time.sleep(120)"),
        rank("psrpc-worker0", "import time; time.sleep(120)"),  # the chief, evaluating
        rank("psrpc-worker1", "pass")]                          # exited, not reaped: a zombie
rank("psrpc-worker2", "pass").wait()                            # exited and reaped
time.sleep(0.5)  # worker1 has exited by then
print("ready", flush=True)
time.sleep(120)
"""


def _dies(p: psutil.Process, timeout_s: float = 5) -> bool:
    """Whether `p` exits (a zombie: the stand-in launcher reaps no one) within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


class _EvaluatingRun(chaos.Run):
    """A launcher stand-in whose ranks are real processes named as psrpc's: ps0 and the chief
    running, worker1 exited (a zombie), worker2 gone; training over, no summary yet."""

    def __init__(self, folder: Path):
        self.folder, self.steps = folder, 120
        self.out, self.ck = folder / "out", folder / "ck"
        self.proc = subprocess.Popen([sys.executable, "-c", _TREE], stdout=subprocess.PIPE,
                                     text=True, start_new_session=True)
        self.sid = self.proc.pid
        assert self.proc.stdout.readline().strip() == "ready"

    def step(self) -> int:
        return self.steps


def test_the_final_evaluations_kill_hits_a_rank_that_is_running(tmp_path):
    """Both workers other than the chief have exited (one a zombie): the old kill_in_eval drew
    one of them and reached nobody (or a zombie). A running rank is killed instead: ps0."""
    run = _EvaluatingRun(tmp_path)
    try:
        ps0 = psutil.Process(run.proc.pid).children()[0]
        assert ps0.name() == "psrpc-ps0"
        result = chaos.FAULTS["kill_in_eval"](run, random.Random(8), 1, 3)
        assert _dies(ps0), f"ps0 was not killed: {result}"
        assert "['ps0']" in result[0] and result[2] is True, result
    finally:
        run.kill_all()
        run.proc.wait(timeout=10)
