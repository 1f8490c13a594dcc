"""The fault campaign: seeded random schedules of faults over the update modes and topologies,
each run checked against the invariants users rely on.

    python -m benchmarks.chaos                     # 100 schedules
    python -m benchmarks.chaos schedules=10 seed=3
    python -m benchmarks.chaos only=[17]           # replay schedule 17 (of seed 0)
    python -m benchmarks.chaos replicas=true schedules=200  # PS faults with backups, ~1 h

Schedule i of seed s is a function of (s, i): an update mode (sync, sync with a backup worker,
async, bounded async), 1-2 PS, 2-4 workers, checkpoints every 10 steps, and one fault from
FAULTS (a SIGKILL of any rank, of two at once, of a rank while it rejoins, a SIGSTOP past
update.timeout_s, a kill during a checkpoint write, during start-up, during the final
evaluation or during shutdown, a truncated or missing checkpoint file, a full disk under
checkpoint.dir, a SIGKILL of the launcher). Each run is `python -m psrpc` in a process group of
its own, as a user starts it; the fault comes from outside, as a scheduler or an operator
delivers it. With hosts=true (the default; it needs root) the campaign also draws HOST_FAULTS
(benchmarks/chaos_hosts.py): the run is then srun-style tasks, one per emulated host, and the
fault a host cut off and healed, a slow link, or a host lost (its task started again, or not;
the chief's; the rendezvous store's). Schedule i of seed s draws the same faults as before
host faults came for i < 14 (the first 14 are one of each local fault).

With replicas=true the campaign draws the faults of PS with backups (REPLICA_FAULTS, each in
turn): a PS killed (rolled back to the checkpoint without backups; failed over with them), a PS
killed twice in a row, two PS together (2 backups on 3 PS), a PS or a worker hung by SIGSTOP for
0.5 s to update.timeout_s + 3 s, a backup's PS hung until a primary gives it up and then that
primary killed, a PS killed again while the chief copies shards to new backups on it, a worker
killed while the epoch of a killed PS forms, a worker lost for good then a PS killed. Each over
WORKLOADS (the cnn and a DLRM with fixed tables, dynamic tables, dense all-reduce; the cnn with
one push per host), its update modes and cluster.ps_replicas 0-2.

After each run:
- it ended within bound_s (else it is a hang: its whole process group is killed);
- it applied train.steps, or its last line names the cause; a run that can finish (no more
  deaths than cluster.max_*_restarts allow, its launcher alive, room on the disk) finished;
- no process of its session, and no /dev/shm segment of its run, is left;
- its newest committed checkpoint loads (checkpoint.find_latest returns that step);
- every shard ended at the summary's step; the steps the chief did again, counted from its own
  step log (metrics.jsonl), are 0 unless the summary names a rollback or a restore, and 0 with
  backups unless every up-to-date copy of a shard may be lost (MAY_LOSE_EVERY_COPY);
- with backups: every backup equals its primary (the summary's digests: the system's own
  report) and each shard replicated as many updates as its version;
- in sync (every worker in each round): its model.pt and exported tables equal, bit for bit,
  those of the uninterrupted run of its config (benchmarks/chaos_oracle.py; one run per config,
  shared), or the summary's `inexact` names why they cannot (a worker lost, a round closed
  without a worker, a dense all-reduce failover's passed step): else a SILENT DIVERGENCE. Sync
  with backup workers and async have no oracle (timing picks what a round or an update holds
  even without a fault): they are held to the invariants above.
A schedule whose fault did not happen (its victim was not running, the moment it waits for
never came, no tmpfs could be mounted...) reads "not delivered", with the reason, and is no
pass: the campaign exits 1 and names it for a replay, as it does a broken invariant (a silent
divergence, a hang, a run without outputs that could finish among them).

results.md (a line per fault: how its schedules ended, the oracle's verdicts, the steps redone),
schedules.md and schedules.csv (a line per schedule: its oracle's verdict, its steps redone),
results.json (every field of every schedule) and plot.png go to `out`.
"""

from __future__ import annotations

import csv
import json
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

import psutil

from benchmarks import chaos_oracle as oracle
from benchmarks.chaos_faults import (FAULTS, MAY_LOSE_EVERY_COPY, REPLICA_DRAW, REPLICA_FAULTS,
                                     TIMEOUT_S, UNDELIVERABLE, Run)
from benchmarks.chaos_hosts import HOST_FAULTS, HostRun
from benchmarks.common import bench_config, header, write_results
from benchmarks.hosts import missing as hosts_missing
from psrpc import checkpoint

MODES = {
    "sync": ["update=sync"],
    "sync-backup": ["update=sync", "update.replicas_to_aggregate=REPLICAS_MINUS_1"],
    "async": ["update=async"],
    "async-bounded": ["update=async", "update.max_staleness=2"],
}
COMMON = ["model=cnn", "data.size=2048", "data.test_size=256", "train.batch_size=16",
          "train.log_every=1", "train.untimed_steps=1", "checkpoint.every_steps=10",
          f"update.timeout_s={TIMEOUT_S}", "cluster.init_timeout_s=60", "train.device=cpu"]


def faults(hosts: bool = True, replicas: bool = False) -> dict:
    """Every fault the campaign draws from: the local ones, then (with `hosts`) the hosts';
    with `replicas`, the PS kills with cluster.ps_replicas only."""
    if replicas:
        return dict(REPLICA_FAULTS)
    return {**FAULTS, **HOST_FAULTS} if hosts else dict(FAULTS)


DLRM = ["model=dlrm", "model.dim=8", "model.bottom=[16,8]", "model.top=[16]", "data=clicks",
        "data.num_samples=4096", "data.test_samples=512", "data.cardinalities=[1000,500,64]",
        "data.num_dense=4", "loss=bce", "metric=auc", "sparse.lr=0.1", "train.log_every=1",
        "train.untimed_steps=1", "checkpoint.every_steps=10", f"update.timeout_s={TIMEOUT_S}",
        "cluster.init_timeout_s=60", "train.device=cpu"]
# replicas=true: what runs (its overrides, the update modes it takes, its steps per
# campaign step: the DLRM's steps are 3x shorter than the cnn's)
WORKLOADS: dict[str, tuple[list, tuple, int]] = {
    "cnn": (COMMON, tuple(MODES), 1),
    "dlrm": (DLRM, tuple(MODES), 3),  # fixed tables, dense on the PS
    "dlrm-dynamic": (DLRM + ["sparse.dynamic=true", "sparse.admit_after=2", "sparse.evict=lfu",
                             "sparse.max_rows=80"], tuple(MODES), 3),
    "dlrm-allreduce": (DLRM + ["update.dense=allreduce"], ("sync",), 3),  # tables on the PS
    # one push per host of its workers' sum, to every shard (over TCP: cluster.shm=off)
    "cnn-host-push": (COMMON + ["update.host_push=on", "cluster.shm=off"], ("sync",), 1),
}


def _replica_schedule(seed: int, index: int) -> dict:
    """replicas=true: faults of PS with backups of every shard (REPLICA_FAULTS, each in turn)
    over WORKLOADS, their update modes and cluster.ps_replicas 0-2 (REPLICA_DRAW says which a
    fault takes): 2-3 PS (3 with 2 backups), 2-3 workers (2 with host pushes: one aligned
    block). In sync the topology follows the backups (2 PS, 3 with 2 backups) so that
    schedules of one config share their uninterrupted run (the oracle)."""
    rnd, drawn = random.Random(seed * 1_000_003 + index), list(REPLICA_FAULTS)
    fault = drawn[index % len(drawn)]
    workload = rnd.choice(list(WORKLOADS))
    mode = rnd.choice(WORKLOADS[workload][1])
    mode = UNDELIVERABLE.get((fault, mode), mode)
    copies = rnd.choice(REPLICA_DRAW[fault][0])
    P = 3 if copies == 2 else rnd.choice([2, 3])
    P = 2 if mode == "sync" and copies < 2 else P
    W = 2 if workload == "cnn-host-push" else rnd.choice([2, 3])
    return {"index": index, "seed": seed, "mode": mode, "num_ps": P, "num_workers": W,
            "fault": fault, "rng": rnd.getrandbits(32), "campaign": "replicas",
            "workload": workload, "ps_replicas": copies}


def schedule(seed: int, index: int, hosts: bool = True, replicas: bool = False) -> dict:
    if replicas:
        return _replica_schedule(seed, index)
    rnd, drawn = random.Random(seed * 1_000_003 + index), list(faults(hosts))
    fault = drawn[index % len(drawn)] if index < len(drawn) else rnd.choice(drawn)
    mode = rnd.choice(list(MODES))
    P, W = rnd.choice([1, 2]), rnd.choice([2, 3, 4])
    if fault == "kill_two" and W == 2:
        W = 3  # two deaths in a group that keeps one worker besides the chief
    if fault in HOST_FAULTS:  # one rank a host: at most 5 hosts
        W = min(W, 3)
        P = 2 if fault == "host_lost_ps_restarted" else P  # (ps0's host holds the store)
    return {"index": index, "seed": seed, "mode": mode, "num_ps": P, "num_workers": W,
            "fault": fault, "rng": rnd.getrandbits(32)}


def overrides(s: dict) -> list[str]:
    """The schedule's config as `python -m psrpc` overrides (its fault's own included)."""
    mode = [o.replace("REPLICAS_MINUS_1", str(s["num_workers"] - 1)) for o in MODES[s["mode"]]]
    extra = ["data.test_size=20000"] if s["fault"] == "kill_in_eval" else []
    base = COMMON
    if s.get("campaign") == "replicas":
        base = WORKLOADS[s["workload"]][0]
        extra = REPLICA_DRAW[s["fault"]][1] + [f"cluster.ps_replicas={s['ps_replicas']}"]
    return base + mode + extra + [f"cluster.num_ps={s['num_ps']}",
                                  f"cluster.num_workers={s['num_workers']}"]


def run_steps(s: dict, steps: int) -> int:
    """The schedule's train.steps: the campaign's, times its workload's factor."""
    return steps * (WORKLOADS[s["workload"]][2] if s.get("campaign") == "replicas" else 1)


def has_oracle(s: dict) -> bool:
    """update=sync with every worker in each round: a run the uninterrupted one predicts."""
    return s["mode"] == "sync"


def _damage_checkpoint(folder: Path, s: dict, steps: int, how: str) -> tuple[str, bool]:
    """A previous run to 30 steps, then its newest shard file truncated or removed; (what was
    done, whether it was: not where that run left no checkpoint, which is said, with its last
    lines, and the run is then an ordinary one)."""
    first = Run(folder / "before", overrides(s), 30)
    first.proc.wait(timeout=120)
    if not checkpoint.steps_on_disk(first.ck):
        tail = first.stderr_path.read_text(errors="replace").strip().splitlines()[-3:]
        return (f"the run before the damage (30 steps) left no checkpoint (exit "
                f"{first.proc.returncode}): " + " | ".join(tail) + "; the run is an ordinary "
                "one", False)
    shutil.move(str(first.ck), str(folder / "ck"))
    newest = checkpoint.steps_on_disk(folder / "ck")[0][1]
    victim = newest / "shard-0.pt"
    if how == "truncate":
        victim.write_bytes(victim.read_bytes()[:-64])
    else:
        victim.unlink()
    return f"{how} {victim.relative_to(folder)} before the run", True


def _tiny_disk(folder: Path) -> Optional[Path]:
    """A 200 KB tmpfs for checkpoint.dir (root, as CI is); None where mounting is not allowed."""
    mnt = folder / "ck"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=200k", "tmpfs", str(mnt)],
                       capture_output=True)
    return mnt if r.returncode == 0 else None


def _start(s: dict, folder: Path, steps: int) -> Run:
    """The schedule's run, without its fault: srun-style tasks over emulated hosts for a host
    fault, else the local launcher."""
    if s["fault"] in HOST_FAULTS:
        return HostRun(folder, overrides(s), steps, n=s["num_ps"] + s["num_workers"])
    return Run(folder, overrides(s), steps)


def run_schedule(s: dict, root: Path, steps: int, bound_s: float,
                 oracles: Optional[oracle.Oracles] = None) -> dict:
    """Run schedule `s` with its fault and check it (`_check`, `_check_result`); in sync its
    result is compared with the uninterrupted run's from `oracles` (none: not compared)."""
    folder = root / f"s{s['index']:03d}"
    folder.mkdir(parents=True)
    steps = run_steps(s, steps)
    rnd = random.Random(s["rng"])
    did, can_finish, delivered, mounted = "", True, True, None
    if s["fault"] in ("truncated_checkpoint", "missing_checkpoint_file"):
        did, delivered = _damage_checkpoint(
            folder, s, steps, "truncate" if s["fault"] == "truncated_checkpoint" else "remove")
    if s["fault"] == "full_disk":
        mounted = _tiny_disk(folder)
        delivered = mounted is not None
        did = ("checkpoint.dir on a 200 KB tmpfs" if mounted else
               "no tmpfs could be mounted here: the run is an ordinary one")
        can_finish = None  # either finishes (saves fail and are logged) or names the cause
    run = _start(s, folder, steps)
    try:
        fn = faults(replicas=s.get("campaign") == "replicas")[s["fault"]]
        if fn is not None:
            did, can_finish, delivered = fn(run, rnd, s["num_ps"], s["num_workers"])
        try:
            run.proc.wait(timeout=max(1.0, bound_s - (time.monotonic() - run.started)))
            hang = False
        except subprocess.TimeoutExpired:
            hang = True
            run.kill_all()
            run.proc.wait(timeout=30)
        wall = time.monotonic() - run.started
        row = {**{k: s[k] for k in ("index", "mode", "num_ps", "num_workers", "fault")},
               **{k: s[k] for k in ("workload", "ps_replicas") if k in s},
               "did": did, "wall_s": round(wall, 1), "exit": run.proc.returncode}
        row.update(_check(run, hang, can_finish, delivered))
        row.update(_check_result(run, s, row, oracles, steps))
    finally:
        run.kill_all()
        if mounted is not None:
            subprocess.run(["umount", "-l", str(mounted)], capture_output=True)
    return row


def _check(run: Run, hang: bool, can_finish: Optional[bool], delivered: bool = True) -> dict:
    """How the run ended and what it broke. `outcome` is how it ended, or "not delivered"
    where its fault did not happen (`ended` keeps how it ended then): such a schedule tested
    nothing, so it is no pass (`ok`) even with every invariant kept (`problems` empty)."""
    problems = []
    summary = None
    if (run.out / "summary.json").exists():
        summary = json.loads((run.out / "summary.json").read_text())
    steps = summary["steps"] if summary else run.step()
    finished = run.proc.returncode == 0 and summary is not None and steps == run.steps
    lines = [ln for ln in run.stderr_path.read_text(errors="replace").splitlines() if ln.strip()]
    cause = next((ln for ln in reversed(lines) if ln.startswith("psrpc: error:")), None)
    if hang:
        outcome = "hang"
        problems.append(f"not over after the bound ({run.step()} steps)")
    elif finished:
        outcome = "finished"
    elif cause is not None:
        outcome = "error"
        if can_finish:
            problems.append(f"could finish, ended with: {cause[:160]}")
    elif run.proc.returncode == -signal.SIGKILL:
        outcome = "killed"  # the launcher itself, by the fault
        if can_finish:
            problems.append("the launcher died")
    else:
        outcome = "unclear"
        problems.append(f"exit {run.proc.returncode} without a line naming the cause")
    deadline = time.monotonic() + 15  # ranks leave within a second of their launcher
    while (run.session() or run.segments()) and time.monotonic() < deadline:
        time.sleep(0.2)
    left, segs = run.session(), run.segments()
    if left:
        problems.append(f"{len(left)} processes left: "
                        + ", ".join(sorted({_name(p) for p in left})))
    if segs:
        problems.append(f"{len(segs)} segments left in /dev/shm")
    committed = [step for step, f in checkpoint.steps_on_disk(run.ck)
                 if (f / checkpoint.MANIFEST).exists()]
    loads = None
    if committed:
        restored = checkpoint.find_latest(str(run.ck))
        loads = restored is not None and restored.step == max(committed)
        if not loads:
            problems.append(f"the newest committed checkpoint (step {max(committed)}) does not "
                            "load")
    return {"outcome": outcome if delivered else "not delivered", "ended": outcome,
            "delivered": delivered, "steps": steps, "could_finish": can_finish,
            "newest_checkpoint": max(committed) if committed else None,
            "checkpoint_loads": loads, "processes_left": len(left), "segments_left": len(segs),
            "ok": delivered and not problems, "problems": "; ".join(problems), "cause": cause}


def _summary(run: Run) -> Optional[dict]:
    path = run.out / "summary.json"
    return json.loads(path.read_text()) if path.exists() else None


def _check_result(run: Run, s: dict, row: dict, oracles: Optional[oracle.Oracles],
                  steps: int) -> dict:
    """Over what `_check` asks, from the run's files: the steps redone (the chief's step log),
    the shards' own invariants (every shard at one version; with backups, each backup equal
    to its primary and each update replicated once), and in sync the result against the
    uninterrupted run's (`oracle`)."""
    summary = _summary(run)
    redone = oracle.redone_steps(run.out / "metrics.jsonl")
    verdict = _oracle(run, s, summary, oracles, steps)
    problems = ([row["problems"]] if row["problems"] else []) + _redone_problems(
        s, summary, redone) + _shard_problems(s, summary)
    if oracle.kind(verdict) in (oracle.SILENT, oracle.BROKEN):
        problems.append(verdict)
    failovers = sum(len(e.get("failovers", [])) for e in (summary or {}).get("epochs", []))
    return {"redone_steps": redone, "failovers": failovers, "oracle": verdict,
            "problems": "; ".join(problems), "ok": row["delivered"] and not problems}


def _oracle(run: Run, s: dict, summary: Optional[dict], oracles: Optional[oracle.Oracles],
            steps: int) -> str:
    """The oracle's verdict on the run's model.pt and tables (chaos_oracle.verdict), or
    "no oracle: why"; "OUTPUTS DO NOT LOAD: ..." for a run's or its oracle's that fail to."""
    if not has_oracle(s):
        return f"{oracle.NONE}: update={s['mode']} (held to its invariants)"
    if oracles is None:
        return f"{oracle.NONE}: not asked"
    try:
        mine = oracle.outputs(run.out)
        if mine is None:
            return f"{oracle.NONE}: the run wrote no model.pt"
        key = ("hosts" if s["fault"] in HOST_FAULTS else "local", steps, *overrides(s))
        ref, why = oracles.get(key, lambda folder: _start(s, folder, steps))
    except Exception as e:  # a torn model.pt, tables that are not one export
        return f"{oracle.BROKEN}: {type(e).__name__}: {str(e)[:200]}"
    if ref is None:
        return f"{oracle.BROKEN}: {why}"
    return oracle.verdict(oracle.compare(mine, ref), summary)


def _redone_problems(s: dict, summary: Optional[dict], redone: int) -> list[str]:
    """Steps redone (from the chief's log) are a problem where the summary names no rollback
    or restore, and with backups unless the fault may lose every up-to-date copy of a shard
    (MAY_LOSE_EVERY_COPY: then the epoch rolls back, saying so)."""
    if not redone or summary is None:
        return []
    rolled = [e["rolled_back_to"] for e in summary.get("epochs", [])
              if e.get("rolled_back_to") is not None]
    restored = summary.get("restored_from_step")
    if not rolled and restored is None:
        return [f"{redone} steps redone (the chief's step log) with no rollback or restore in "
                "the summary"]
    copies = s.get("ps_replicas") or 0
    if copies and copies not in MAY_LOSE_EVERY_COPY.get(s["fault"], ()):
        return [f"{redone} steps redone with cluster.ps_replicas={copies} (rolled back to "
                f"{rolled}, restored from {restored})"]
    return []


def _shard_problems(s: dict, summary: Optional[dict]) -> list[str]:
    """Every shard at the summary's step; with backups, every backup equal to its primary
    (the system's digests) and each shard's updates replicated once each (as many as its
    version, where nothing was rolled back)."""
    if summary is None:
        return []
    shards, out = summary.get("shards", []), []
    versions = sorted({sh["version"] for sh in shards})
    if versions and versions != [summary["steps"]]:
        out.append(f"shards ended at versions {versions}, the summary at {summary['steps']}")
    if not s.get("ps_replicas"):
        return out
    if not summary.get("replicas", {}).get("agree"):
        out.append(f"backups differ from their primaries: {summary.get('replicas')}")
    rolled = any(e.get("rolled_back_to") is not None for e in summary.get("epochs", []))
    off = [f"shard {sh['shard']} {sh.get('replicated')} of {sh['version']}" for sh in shards
           if sh.get("replicated") != sh["version"]]
    if off and not rolled and summary.get("restored_from_step") is None:
        out.append("updates replicated differ from the version: " + ", ".join(off))
    return out


def _name(p: psutil.Process) -> str:
    try:
        return p.name()
    except psutil.Error:
        return str(p.pid)


def summarize(rows: list[dict]) -> list[dict]:
    """One line per fault: how its schedules ended. `passed`: delivered and every invariant
    kept; a schedule whose fault was not delivered counts under `not_delivered` only (its hang
    or broken invariant, if any, too). The oracle's verdicts (sync): equal to the uninterrupted
    run, a divergence the summary names, a silent one; and the steps redone (the chief's log)."""
    out = []
    for fault in {**faults(), **REPLICA_FAULTS}:
        mine = [r for r in rows if r["fault"] == fault]
        if not mine:
            continue
        count = lambda cond: sum(1 for r in mine if cond(r))  # noqa: E731
        verdicts = lambda k: count(lambda r: oracle.kind(r.get("oracle")) == k)  # noqa: E731
        out.append({"fault": fault, "schedules": len(mine),
                    "passed": count(lambda r: r["ok"]),
                    "finished": count(lambda r: r["outcome"] == "finished"),
                    "clear_error": count(lambda r: r["outcome"] == "error"),
                    "launcher_killed": count(lambda r: r["outcome"] == "killed"),
                    "not_delivered": count(lambda r: r["outcome"] == "not delivered"),
                    "hangs": count(lambda r: r.get("ended", r["outcome"]) == "hang"),
                    "left_behind": count(lambda r: r["processes_left"] or r["segments_left"]),
                    "checkpoint_fails": count(lambda r: r["checkpoint_loads"] is False),
                    "oracle_equal": verdicts(oracle.EQUAL),
                    "named_divergence": verdicts(oracle.NAMED),
                    "silent_divergence": verdicts(oracle.SILENT),
                    "outputs_broken": verdicts(oracle.BROKEN),
                    "steps_redone": sum(r.get("redone_steps") or 0 for r in mine),
                    "violations": count(lambda r: bool(r["problems"])),
                    "mean_wall_s": round(sum(r["wall_s"] for r in mine) / len(mine), 1)})
    return out


SCHEDULE_COLUMNS = ["index", "mode", "workload", "num_ps", "num_workers", "ps_replicas", "fault",
                    "outcome", "oracle", "redone_steps", "failovers", "wall_s", "ok", "problems",
                    "did"]


def write_schedules(out_dir: Path, rows: list[dict]) -> None:
    """schedules.csv and schedules.md: a line per schedule, with its oracle's verdict and the
    steps redone (results.json's `schedules` holds every field)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "schedules.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=SCHEDULE_COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    cell = lambda v: "" if v is None else str(v).replace("|", "/")  # noqa: E731
    lines = ["| " + " | ".join(SCHEDULE_COLUMNS) + " |", "|" + "---|" * len(SCHEDULE_COLUMNS)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in SCHEDULE_COLUMNS) + " |" for r in rows]
    (out_dir / "schedules.md").write_text("\n".join(lines) + "\n")


def _plot(plt, rows):
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4.5), sharey=True)
    for axis, kinds, colors, title in (
            (ax, ["finished", "clear_error", "launcher_killed", "not_delivered", "hangs"],
             ["tab:blue", "tab:orange", "tab:gray", "tab:olive", "tab:red"],
             "How each fault's schedules ended"),
            (bx, ["oracle_equal", "named_divergence", "silent_divergence", "outputs_broken"],
             ["tab:blue", "tab:orange", "tab:red", "tab:purple"],
             "Their result against the uninterrupted run (sync)")):
        left = [0] * len(rows)
        for kind, color in zip(kinds, colors):
            vals = [r[kind] for r in rows]
            axis.barh([r["fault"] for r in rows], vals, left=left, color=color,
                      label=kind.replace("_", " "))
            left = [a + b for a, b in zip(left, vals)]
        axis.set_xlabel("schedules")
        axis.set_title(title, fontsize=10)
        axis.legend(loc="lower right", fontsize=8)
    ax.invert_yaxis()
    return fig


def report(rows: list[dict], seed: int, total_s: float) -> str:
    """The campaign's verdict in a paragraph: what broke, what was never delivered, and how
    to replay either."""
    bad = [r["index"] for r in rows if r["problems"]]
    missed = [r["index"] for r in rows if not r["delivered"]]
    silent = [r["index"] for r in rows if oracle.kind(r.get("oracle")) == oracle.SILENT]
    kinds = [oracle.kind(r.get("oracle")) for r in rows]
    replay = lambda xs: f" (replay: only=[{','.join(map(str, xs))}])" if xs else ""  # noqa: E731
    return (f"{len(rows)} schedules (seed {seed}) in {total_s / 60:.1f} min, "
            f"{sum(r['ok'] for r in rows)} passed: "
            f"{sum(r['ended'] == 'hang' for r in rows)} hangs, "
            f"{sum(r['processes_left'] + r['segments_left'] > 0 for r in rows)} runs left "
            f"processes or segments, {sum(r['checkpoint_loads'] is False for r in rows)} "
            f"newest committed checkpoints that do not load, "
            f"{sum(1 for r in rows if r['could_finish'] and r['ended'] != 'finished')} runs "
            f"that could finish and did not; against the uninterrupted run (sync): "
            f"{kinds.count(oracle.EQUAL)} equal, {kinds.count(oracle.NAMED)} named "
            f"divergences, {len(silent)} silent divergences" + replay(silent)
            + f", {kinds.count(oracle.BROKEN)} outputs that do not load; "
            f"{sum(r.get('redone_steps') or 0 for r in rows)} steps redone (the chiefs' logs); "
            f"{len(bad)} schedules broke an invariant" + replay(bad)
            + f"; {len(missed)} schedules' faults were not delivered (no pass: "
            "they tested nothing)" + replay(missed) + ". Every schedule: `results.json` "
            "(`schedules`: what it did, how it ended, what was checked), `schedules.md`.")


def campaign(schedules: list[dict], steps: int, bound_s: float,
             log: Callable[[str], None] = print, keep: Optional[Path] = None,
             keep_all: bool = False) -> list[dict]:
    """Run the schedules; a schedule that breaks an invariant or whose fault was not delivered
    (every schedule with `keep_all`) keeps its logs and stderr under `keep`/s<index> (for the
    replay's diagnosis)."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="psrpc-chaos-") as tmp:
        oracles = oracle.Oracles(Path(tmp) / "oracles", bound_s)
        for s in schedules:
            row = run_schedule(s, Path(tmp), steps, bound_s, oracles)
            rows.append(row)
            if keep is not None and (keep_all or not row["ok"]):
                folder = Path(tmp) / f"s{s['index']:03d}"
                shutil.copytree(folder, keep / folder.name, dirs_exist_ok=True,
                                ignore=shutil.ignore_patterns("*.pt", "tensorboard"))
            verdict = "; ".join(
                (["NOT DELIVERED"] if not row["delivered"] else [])
                + ([f"VIOLATION: {row['problems']}"] if row["problems"] else [])) or "ok"
            what = (f"{s['workload']:14s} k={s['ps_replicas']} " if "workload" in s else "")
            log(f"[{s['index']:3d}] {s['mode']:13s} {what}P={s['num_ps']} W={s['num_workers']} "
                f"{s['fault']:24s} {row['outcome']:8s} {row['wall_s']:6.1f} s "
                f"redone {row['redone_steps']}, {row['oracle'][:90]}; {verdict}  ({row['did']})")
    return rows


def main(argv: list[str]) -> None:
    opts = bench_config("chaos", argv)
    if opts.hosts and not opts.replicas and (why := hosts_missing()) is not None:
        sys.exit(f"benchmarks.chaos: hosts=true draws host faults, but {why}; run it as root "
                 "or with hosts=false")
    meta = header()
    indices = list(opts.only) if opts.only else list(range(opts.schedules))
    plan = [schedule(opts.seed, i, opts.hosts, opts.replicas) for i in indices]
    t0 = time.monotonic()
    rows = campaign(plan, opts.steps, opts.bound_s, keep=Path(opts.out) / "violations",
                    keep_all=opts.keep_all)
    total = time.monotonic() - t0
    per_fault = summarize(rows)
    notes = report(rows, opts.seed, total)
    meta["schedules"] = rows
    write_results(Path(opts.out), meta, per_fault, list(per_fault[0]) if per_fault else [],
                  "Fault campaign: every schedule ends, leaves nothing, keeps its checkpoint "
                  "and, in sync, the uninterrupted run's result", plot=_plot, notes=notes)
    write_schedules(Path(opts.out), rows)
    print(notes)
    sys.exit(0 if all(r["ok"] for r in rows) else 1)


if __name__ == "__main__":
    main(sys.argv[1:])
