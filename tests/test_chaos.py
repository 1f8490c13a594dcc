"""The fault campaign's quick subset: a few seeded schedules of benchmarks/chaos.py (the whole
campaign, 100 schedules, is `python -m benchmarks.chaos`), each checked for every invariant:
it ends within its bound, finishes when it can (or names the cause), leaves no process and no
/dev/shm segment, and its newest committed checkpoint loads; and its fault was delivered. And
the harness's own honesty, on stand-in runs: a fault that reached nobody is reported as not
delivered and counted as no pass; the final evaluation's kill picks a rank that is running.
And the oracle's pieces (benchmarks/chaos_oracle.py), without a cluster: steps redone counted
from a chief's step log, models and tables compared bit for bit from their files, a difference
silent unless the summary's `inexact` names why, the summary's reasons, the replica campaign's
schedules covering every dimension."""

import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import torch

from benchmarks import chaos, chaos_oracle, hosts

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


# -- the oracle's pieces, without a cluster ---------------------------------------------------
def _metrics(path: Path, steps: list[int]) -> Path:
    """A chief's metrics.jsonl: a training record a step (an evaluation's record among them)."""
    lines = [json.dumps({"step": s, "loss": 0.5, "samples": 16 * s}) for s in steps]
    lines.insert(2, json.dumps({"step": steps[1], "test_accuracy": 0.5}))
    path.write_text("\n".join(lines) + "\n{\"step\": 9")  # a torn last line
    return path


def test_steps_redone_are_counted_from_the_chiefs_step_log(tmp_path):
    """A step logged again after a higher one was done again: a rollback from 14 to 10 redoes
    11-14, a restart from 12 once 16 was reached redoes 13-16; an evaluation's record at a step
    already logged, and a torn line, are no step."""
    log = _metrics(tmp_path / "m.jsonl", [*range(1, 15), *range(11, 17), *range(13, 20)])
    assert chaos_oracle.logged_steps(log)[:3] == [1, 2, 3]
    assert chaos_oracle.redone_steps(log) == 4 + 4
    assert chaos_oracle.redone_steps(_metrics(tmp_path / "plain.jsonl", list(range(1, 30)))) == 0
    assert chaos_oracle.redone_steps(tmp_path / "none.jsonl") == 0


def test_models_are_compared_bit_for_bit_from_their_files(tmp_path):
    """model.pt as saved, loaded with weights_only: the smallest difference of one weight is a
    difference; tables (a fixed one, a dynamic one's ids and rows) too."""
    state = {"w": torch.randn(4, 3), "b": torch.zeros(3), "n": torch.tensor(7)}
    for name, tweak in [("same", None), ("off", "w")]:
        folder = tmp_path / name
        folder.mkdir()
        saved = {k: v.clone() for k, v in state.items()}
        if tweak:
            saved[tweak][1, 2] = torch.nextafter(saved[tweak][1, 2], torch.tensor(9.0))
        torch.save(saved, folder / "model.pt")
    same, off = (chaos_oracle.outputs(tmp_path / n) for n in ("same", "off"))
    assert chaos_oracle.compare(same, {"model": state, "tables": {}}) == []
    (diff,) = chaos_oracle.compare(off, {"model": state, "tables": {}})
    assert diff.startswith("model.pt w: max |diff|")
    assert chaos_oracle.outputs(tmp_path / "nothing") is None
    dyn = SimpleNamespace(ids=torch.arange(5), weight=torch.ones(5, 2))
    moved = SimpleNamespace(ids=torch.tensor([0, 1, 2, 3, 6]), weight=torch.ones(5, 2))
    assert chaos_oracle.differences({"t": dyn}, {"t": dyn}) == []
    assert chaos_oracle.differences({"t": dyn}, {"t": moved}) == ["t.ids: max |diff| 1"]


def test_a_difference_is_silent_unless_the_summary_names_why():
    diffs = ["model.pt w: max |diff| 1e-07"]
    assert chaos_oracle.verdict([], {"inexact": ["workers lost for good: worker1"]}) == "equal"
    assert chaos_oracle.verdict(diffs, {"inexact": []}).startswith("SILENT DIVERGENCE: model.pt")
    assert chaos_oracle.verdict(diffs, {}).startswith("SILENT DIVERGENCE")
    named = chaos_oracle.verdict(diffs, {"inexact": ["workers lost for good: worker1"]})
    assert named == "named divergence: workers lost for good: worker1"
    assert [chaos_oracle.kind(v) for v in ("equal", named, "SILENT DIVERGENCE: x",
                                           "no oracle: update=async", None)] == \
        ["equal", "named divergence", "SILENT DIVERGENCE", "no oracle", "no oracle"]


def test_the_summary_names_why_a_sync_run_is_inexact():
    """summary["inexact"]: W gradients a step on each shard, else each cause the shard counted
    for a round without a worker, named; a shortfall no counter explains is UNEXPLAINED, which
    the oracle takes for no reason at all."""
    from psrpc.session.outputs import inexact

    def cfg(name="sync"):
        return SimpleNamespace(update=SimpleNamespace(name=name))
    topo = SimpleNamespace(num_workers=2)
    full = [{"shard": 0, "version": 30, "per_worker_applied": {0: 30, 1: 30}, "short": {}}]
    timed_out = [{"shard": 0, "version": 30, "per_worker_applied": {0: 30, 1: 28},
                  "short": {"timeout": 2}}]
    passed = [{"shard": 0, "version": 30, "per_worker_applied": {0: 29, 1: 29},
               "short": {"passed": 2}}]
    unexplained = [{"shard": 0, "version": 30, "per_worker_applied": {0: 30, 1: 28},
                    "short": {}}]
    assert inexact(cfg(), topo, full, []) == []
    assert inexact(cfg(name="async"), topo, timed_out, [1]) == []
    assert inexact(cfg(), topo, full, [1]) == ["workers lost for good: worker1"]
    (why,) = inexact(cfg(), topo, timed_out, [])
    assert "update.timeout_s" in why and "(2 gradients)" in why
    assert "passed without an update" in inexact(cfg(), topo, passed, [])[0]
    (why,) = inexact(cfg(), topo, unexplained, [])
    assert why.startswith("UNEXPLAINED") and "2 gradients" in why
    summary = {"inexact": [why]}
    assert chaos_oracle.verdict(["model.pt w: differs"], summary).startswith("SILENT")


def test_the_replica_campaign_covers_every_dimension(tmp_path):
    """200 schedules of a seed: every fault, update mode, workload (dense on the PS and all-
    reduce, fixed and dynamic tables, host pushes) and cluster.ps_replicas 0-2, each in sync
    (with an oracle) too where it has one; configs compose as the CLI would (one of each
    workload, mode, with and without backups); sync schedules of one config share their
    uninterrupted run."""
    plan = [chaos.schedule(0, i, replicas=True) for i in range(200)]
    seen = lambda key: {s[key] for s in plan}  # noqa: E731
    assert seen("fault") == set(chaos.REPLICA_FAULTS)
    assert seen("mode") == set(chaos.MODES) and seen("workload") == set(chaos.WORKLOADS)
    assert seen("ps_replicas") == {0, 1, 2}
    sync = [s for s in plan if chaos.has_oracle(s)]
    assert {s["workload"] for s in sync} == set(chaos.WORKLOADS)
    assert {s["ps_replicas"] for s in sync} == {0, 1, 2} and len(sync) >= 60
    assert len({tuple(chaos.overrides(s)) for s in sync}) <= len(sync) // 2
    for s in plan:
        fault = s["fault"]
        assert s["ps_replicas"] in chaos.REPLICA_DRAW[fault][0]
        assert s["num_ps"] > s["ps_replicas"] and (s["ps_replicas"] < 2 or s["num_ps"] == 3)
    from tests.conftest import compose
    for s in {(s["workload"], s["mode"], s["ps_replicas"] > 0): s for s in plan}.values():
        compose(chaos.overrides(s) + [f"train.steps={chaos.run_steps(s, 120)}",
                                      f"checkpoint.dir={tmp_path}"])


class _Finished:
    """A run's files as the checks read them: a summary, a step log, model.pt."""

    def __init__(self, folder: Path, summary: dict, steps: list[int], state: dict):
        self.out = folder / "out"
        self.out.mkdir(parents=True)
        (self.out / "summary.json").write_text(json.dumps(summary))
        _metrics(self.out / "metrics.jsonl", steps)
        torch.save(state, self.out / "model.pt")


def test_a_silent_divergence_and_an_unnamed_redo_break_the_schedule(tmp_path):
    """With 1 backup: a result off the oracle's (the summary naming no reason) is a silent
    divergence; steps redone in the chief's log are a problem (nothing may roll back with a
    backup, and the summary names no rollback); shards at two versions; backups that differ."""
    s = {"mode": "sync", "fault": "kill_ps_replicated", "ps_replicas": 1, "num_ps": 2,
         "num_workers": 2, "campaign": "replicas", "workload": "cnn"}
    summary = {"steps": 20, "epochs": [{"rolled_back_to": None, "failovers": [{}]}],
               "restored_from_step": None, "inexact": [], "replicas": {"agree": False},
               "shards": [{"shard": 0, "version": 20, "replicated": 20},
                          {"shard": 1, "version": 19, "replicated": 19}]}
    ref = {"w": torch.ones(3)}
    run = _Finished(tmp_path, summary, [*range(1, 15), *range(11, 21)], {"w": torch.zeros(3)})
    oracles = chaos_oracle.Oracles(tmp_path / "o", 30)
    row = {"problems": "", "delivered": True}
    got = chaos._check_result(run, s, row, _Cached(oracles, {"model": ref, "tables": {}}), 120)
    assert got["redone_steps"] == 4 and got["failovers"] == 1 and not got["ok"]
    assert got["oracle"].startswith("SILENT DIVERGENCE: model.pt w")
    for part in ("4 steps redone", "versions [19, 20]", "backups differ", "SILENT"):
        assert part in got["problems"], got["problems"]


class _Cached(chaos_oracle.Oracles):
    """Oracles whose every config's uninterrupted run is `outputs`."""

    def __init__(self, like: chaos_oracle.Oracles, outputs: dict):
        super().__init__(like.root, like.bound_s)
        self.outputs = outputs

    def get(self, key, start):
        return self.outputs, ""
