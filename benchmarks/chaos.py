"""The fault campaign: seeded random schedules of faults over the update modes and topologies,
each run checked against the invariants users rely on.

    python -m benchmarks.chaos                     # 100 schedules
    python -m benchmarks.chaos schedules=10 seed=3
    python -m benchmarks.chaos only=[17]           # replay schedule 17 (of seed 0)
    python -m benchmarks.chaos replicas=true schedules=12   # PS kills with shard backups

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

With replicas=true the campaign draws only PS kills with cluster.ps_replicas (REPLICA_FAULTS:
any PS, a PS twice in a row, two PS together with 2 backups on 3 PS), each update mode in turn,
and checks also that nothing was rolled back (0 steps redone) and that every backup equals its
primary at the end.

After each run:
- it ended within bound_s (else it is a hang: its whole process group is killed);
- it applied train.steps, or its last line names the cause; a run that can finish (no more
  deaths than cluster.max_*_restarts allow, its launcher alive, room on the disk) finished;
- no process of its session, and no /dev/shm segment of its run, is left;
- its newest committed checkpoint loads (checkpoint.find_latest returns that step).
A schedule whose fault did not happen (its victim was not running, the moment it waits for
never came, no tmpfs could be mounted...) reads "not delivered", with the reason, and is no
pass: the campaign exits 1 and names it for a replay, as it does a broken invariant.
"""

from __future__ import annotations

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

from benchmarks.chaos_faults import FAULTS, REPLICA_FAULTS, TIMEOUT_S, Run
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
          "train.log_every=1", "train.warmup_steps=1", "checkpoint.every_steps=10",
          f"update.timeout_s={TIMEOUT_S}", "cluster.init_timeout_s=60", "train.device=cpu"]


def faults(hosts: bool = True, replicas: bool = False) -> dict:
    """Every fault the campaign draws from: the local ones, then (with `hosts`) the hosts';
    with `replicas`, the PS kills with cluster.ps_replicas only."""
    if replicas:
        return dict(REPLICA_FAULTS)
    return {**FAULTS, **HOST_FAULTS} if hosts else dict(FAULTS)


def _replica_schedule(seed: int, index: int) -> dict:
    """replicas=true: PS kills with backups of every shard; 2-3 PS (3 with 2 backups for two
    PS killed together, so a copy of each shard is left), 2-3 workers, each update mode."""
    rnd, drawn = random.Random(seed * 1_000_003 + index), list(REPLICA_FAULTS)
    fault = drawn[index % len(drawn)]
    mode = list(MODES)[(index // len(drawn)) % len(MODES)]
    P = 3 if fault == "kill_two_ps" else rnd.choice([2, 3])
    return {"index": index, "seed": seed, "mode": mode, "num_ps": P,
            "num_workers": rnd.choice([2, 3]), "fault": fault, "rng": rnd.getrandbits(32),
            "ps_replicas": 2 if fault == "kill_two_ps" else 1}


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
    mode = [o.replace("REPLICAS_MINUS_1", str(s["num_workers"] - 1)) for o in MODES[s["mode"]]]
    extra = ["data.test_size=20000"] if s["fault"] == "kill_in_eval" else []
    copies = [f"cluster.ps_replicas={s['ps_replicas']}"] if s.get("ps_replicas") else []
    return COMMON + mode + extra + copies + [f"cluster.num_ps={s['num_ps']}",
                                             f"cluster.num_workers={s['num_workers']}"]


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


def run_schedule(s: dict, root: Path, steps: int, bound_s: float) -> dict:
    folder = root / f"s{s['index']:03d}"
    folder.mkdir(parents=True)
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
    if s["fault"] in HOST_FAULTS:
        run = HostRun(folder, overrides(s), steps, n=s["num_ps"] + s["num_workers"])
    else:
        run = Run(folder, overrides(s), steps)
    try:
        fn = faults(replicas=bool(s.get("ps_replicas")))[s["fault"]]
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
               "did": did, "wall_s": round(wall, 1), "exit": run.proc.returncode}
        row.update(_check(run, hang, can_finish, delivered))
        if s.get("ps_replicas"):
            row.update(_check_replicas(run, row))
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


def _check_replicas(run: Run, row: dict) -> dict:
    """With cluster.ps_replicas, over what `_check` asks: every epoch failed over (nothing
    rolled back, no restore: 0 steps redone) and every backup equals its primary at the end."""
    path = run.out / "summary.json"
    if not path.exists():
        return {}
    summary = json.loads(path.read_text())
    epochs = summary.get("epochs", [])
    redone = sum(e["at_step"] - e["rolled_back_to"] for e in epochs
                 if e.get("rolled_back_to") is not None)
    problems = [p for p in [row["problems"]] if p]
    if redone or summary.get("restored_from_step") is not None:
        problems.append(f"{redone} steps redone (rolled back: "
                        f"{[e['rolled_back_to'] for e in epochs]}, restored from "
                        f"{summary.get('restored_from_step')})")
    if not summary.get("replicas", {}).get("agree"):
        problems.append(f"backups differ from their primaries: {summary.get('replicas')}")
    failovers = sum(len(e.get("failovers", [])) for e in epochs)
    return {"redone_steps": redone, "failovers": failovers, "problems": "; ".join(problems),
            "ok": row["delivered"] and not problems}


def _name(p: psutil.Process) -> str:
    try:
        return p.name()
    except psutil.Error:
        return str(p.pid)


def summarize(rows: list[dict]) -> list[dict]:
    """One line per fault: how its schedules ended. `passed`: delivered and every invariant
    kept; a schedule whose fault was not delivered counts under `not_delivered` only (its hang
    or broken invariant, if any, too)."""
    out = []
    for fault in {**faults(), **REPLICA_FAULTS}:
        mine = [r for r in rows if r["fault"] == fault]
        if not mine:
            continue
        count = lambda cond: sum(1 for r in mine if cond(r))  # noqa: E731
        out.append({"fault": fault, "schedules": len(mine),
                    "passed": count(lambda r: r["ok"]),
                    "finished": count(lambda r: r["outcome"] == "finished"),
                    "clear_error": count(lambda r: r["outcome"] == "error"),
                    "launcher_killed": count(lambda r: r["outcome"] == "killed"),
                    "not_delivered": count(lambda r: r["outcome"] == "not delivered"),
                    "hangs": count(lambda r: r.get("ended", r["outcome"]) == "hang"),
                    "left_behind": count(lambda r: r["processes_left"] or r["segments_left"]),
                    "checkpoint_fails": count(lambda r: r["checkpoint_loads"] is False),
                    "violations": count(lambda r: bool(r["problems"])),
                    "mean_wall_s": round(sum(r["wall_s"] for r in mine) / len(mine), 1)})
    return out


def _plot(plt, rows):
    fig, ax = plt.subplots(figsize=(9, 4))
    kinds = ["finished", "clear_error", "launcher_killed", "not_delivered", "hangs"]
    left = [0] * len(rows)
    for kind in kinds:
        vals = [r[kind] for r in rows]
        ax.barh([r["fault"] for r in rows], vals, left=left, label=kind.replace("_", " "))
        left = [a + b for a, b in zip(left, vals)]
    ax.set_xlabel("schedules")
    ax.set_title("How each fault's schedules ended")
    ax.legend(loc="lower right", fontsize=8)
    ax.invert_yaxis()
    return fig


def report(rows: list[dict], seed: int, total_s: float) -> str:
    """The campaign's verdict in a paragraph: what broke, what was never delivered, and how
    to replay either."""
    bad = [r["index"] for r in rows if r["problems"]]
    missed = [r["index"] for r in rows if not r["delivered"]]
    replay = lambda xs: f" (replay: only=[{','.join(map(str, xs))}])" if xs else ""  # noqa: E731
    return (f"{len(rows)} schedules (seed {seed}) in {total_s / 60:.1f} min, "
            f"{sum(r['ok'] for r in rows)} passed: "
            f"{sum(r['ended'] == 'hang' for r in rows)} hangs, "
            f"{sum(r['processes_left'] + r['segments_left'] > 0 for r in rows)} runs left "
            f"processes or segments, {sum(r['checkpoint_loads'] is False for r in rows)} "
            f"newest committed checkpoints that do not load, "
            f"{sum(1 for r in rows if r['could_finish'] and r['ended'] != 'finished')} runs "
            f"that could finish and did not; {len(bad)} schedules broke an invariant"
            + replay(bad) + f"; {len(missed)} schedules' faults were not delivered (no pass: "
            "they tested nothing)" + replay(missed) + ". Every schedule: `results.json` "
            "(`rows`: what it did, how it ended, what was checked).")


def campaign(schedules: list[dict], steps: int, bound_s: float,
             log: Callable[[str], None] = print, keep: Optional[Path] = None,
             keep_all: bool = False) -> list[dict]:
    """Run the schedules; a schedule that breaks an invariant or whose fault was not delivered
    (every schedule with `keep_all`) keeps its logs and stderr under `keep`/s<index> (for the
    replay's diagnosis)."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="psrpc-chaos-") as tmp:
        for s in schedules:
            row = run_schedule(s, Path(tmp), steps, bound_s)
            rows.append(row)
            if keep is not None and (keep_all or not row["ok"]):
                folder = Path(tmp) / f"s{s['index']:03d}"
                shutil.copytree(folder, keep / folder.name, dirs_exist_ok=True,
                                ignore=shutil.ignore_patterns("*.pt", "tensorboard"))
            verdict = "; ".join(
                (["NOT DELIVERED"] if not row["delivered"] else [])
                + ([f"VIOLATION: {row['problems']}"] if row["problems"] else [])) or "ok"
            log(f"[{s['index']:3d}] {s['mode']:13s} P={s['num_ps']} W={s['num_workers']} "
                f"{s['fault']:24s} {row['outcome']:8s} {row['wall_s']:6.1f} s "
                f"{verdict}  ({row['did']})")
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
                  "Fault campaign: every schedule ends, leaves nothing, keeps its checkpoint",
                  plot=_plot, notes=notes)
    print(notes)
    sys.exit(0 if all(r["ok"] for r in rows) else 1)


if __name__ == "__main__":
    main(sys.argv[1:])
