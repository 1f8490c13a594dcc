"""The fault campaign's hands (benchmarks/chaos.py runs the schedules and checks them): `Run`,
one `python -m psrpc` in a process group of its own watched from outside, and the faults it
delivers to a run (FAULTS), as a scheduler or an operator would."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import psutil

from benchmarks.common import ROOT
from psrpc import checkpoint
from psrpc.cluster import shm

TIMEOUT_S = 3.0  # update.timeout_s of every run: a SIGSTOP past it must not stall the others


class Run:
    """One `python -m psrpc` in a process group of its own, watched from outside."""

    def __init__(self, folder: Path, overrides: list[str], steps: int):
        self.folder, self.steps = folder, steps
        self.out, self.ck = folder / "out", folder / "ck"
        folder.mkdir(parents=True, exist_ok=True)
        self.stderr_path = folder / "stderr.txt"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "psrpc", *overrides, f"train.steps={steps}",
             f"checkpoint.dir={self.ck}", f"out_dir={self.out}"],
            cwd=folder, stdout=subprocess.DEVNULL, stderr=open(self.stderr_path, "w"),
            start_new_session=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        self.sid = self.proc.pid
        self.started = time.monotonic()

    def step(self) -> int:
        """The last global step the chief logged (metrics.jsonl, one record a step)."""
        try:
            with open(self.out / "metrics.jsonl", "rb") as f:
                f.seek(max(0, os.fstat(f.fileno()).st_size - 4096))
                lines = [ln for ln in f.read().decode(errors="replace").splitlines() if ln]
        except OSError:
            return 0
        for line in reversed(lines):
            try:
                return int(json.loads(line).get("step", 0))
            except (ValueError, AttributeError):
                continue
        return 0

    def ranks(self) -> dict[str, psutil.Process]:
        """name (psrpc-ps0, psrpc-worker1, ...) -> process, of this run only, alive now (a rank
        that has exited, a zombie its launcher has not reaped yet included, is none: a signal
        sent to it would reach nobody)."""
        found = {}
        try:
            for p in psutil.Process(self.proc.pid).children(recursive=True):
                try:
                    name = p.name()
                    if p.status() == psutil.STATUS_ZOMBIE:
                        continue
                except psutil.Error:
                    continue
                if name.startswith("psrpc-"):
                    found[name[len("psrpc-"):]] = p
        except psutil.Error:
            pass
        return found

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_for(self, cond: Callable[[], bool], timeout_s: float, every_s: float = 0.02) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.alive():
            if cond():
                return True
            time.sleep(every_s)
        return cond()

    def signal(self, names: list[str], sig: int) -> list[str]:
        """Send `sig` to these ranks at once; the names it reached."""
        ranks, hit = self.ranks(), []
        for n in names:
            p = ranks.get(n)
            if p is not None:
                try:
                    p.send_signal(sig)
                    hit.append(n)
                except psutil.Error:
                    pass
        return hit

    def session(self) -> list[psutil.Process]:
        """Every live process of this run's session (the launcher's, its helpers', the ranks')."""
        left = []
        for p in psutil.process_iter():
            try:
                if p.pid != os.getpid() and os.getsid(p.pid) == self.sid and p.status() != \
                        psutil.STATUS_ZOMBIE:
                    left.append(p)
            except (psutil.Error, OSError):
                continue
        return left

    def segments(self) -> list[str]:
        return sorted(p.name for p in shm.directory().glob(f"psrpc-{self.proc.pid}x*"))

    def kill_all(self) -> None:
        try:
            os.killpg(self.sid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


# -- the faults --------------------------------------------------------------------------------
# Each takes the run, the schedule's Random and its topology; returns what it did (for the
# report), whether the run can still finish all its steps (True), cannot (False), or may
# either finish or end with a line naming the cause (None), and whether the fault happened as
# scheduled. One that did not (its victim was not running, the run had ended, the moment it
# waits for never came) says why: that schedule tested nothing and is no pass.

def _result(did: str, can_finish: Optional[bool], missed: str = "") -> tuple:
    return (did + (f"; not delivered: {missed}" if missed else ""), can_finish, not missed)


def _kill(run: Run, victims: list[str], sig: int = signal.SIGKILL) -> tuple[list[str], str]:
    """Send `sig` to `victims`; (the names it reached, why it missed the others or "")."""
    hit = run.signal(victims, sig)
    gone = [v for v in victims if v not in hit]
    if not gone:
        return hit, ""
    return hit, (f"{', '.join(gone)} not running"
                 + ("" if run.alive() else f" (the run had ended, exit {run.proc.returncode})"))


def _at_step(run: Run, rnd: random.Random) -> int:
    k = rnd.randint(15, run.steps - 40)
    run.wait_for(lambda: run.step() >= k, 60)
    return run.step()


def _recoverable(run: Run, victims) -> bool:
    """Whether the run can still finish after `victims` die: a PS's shards roll back to the
    last committed checkpoint, so a PS lost before the first commit ends the run (with a line
    saying so, which is right); workers rejoin, and the chief's group restarts from a
    checkpoint or from scratch."""
    if not any(str(v).startswith("ps") for v in victims):
        return True
    return any((f / checkpoint.MANIFEST).exists() for _, f in checkpoint.steps_on_disk(run.ck))


def _committed(run: Run) -> list[int]:
    return [step for step, f in checkpoint.steps_on_disk(run.ck)
            if (f / checkpoint.MANIFEST).exists()]


def _workers(P: int, W: int, chief: bool = False) -> list[str]:
    return [f"worker{i}" for i in range(0 if chief else 1, W)]


def _ps(P: int) -> list[str]:
    return [f"ps{k}" for k in range(P)]


def _alive_one(run: Run, rnd: random.Random, drawn: str, pool: list[str]) -> str:
    """`drawn` where it is running now, else one of `pool` that is (else `drawn`, to miss)."""
    live = run.ranks()
    if drawn in live:
        return drawn
    running = [n for n in pool if n in live]
    return rnd.choice(running) if running else drawn


def kill_worker(run, rnd, P, W):
    victim = rnd.choice(_workers(P, W))
    at = _at_step(run, rnd)
    hit, missed = _kill(run, [victim])
    return _result(f"SIGKILL {hit} at step {at}", True, missed)


def kill_chief(run, rnd, P, W):
    at = _at_step(run, rnd)
    hit, missed = _kill(run, ["worker0"])
    return _result(f"SIGKILL {hit} at step {at}", True, missed)


def kill_ps(run, rnd, P, W):
    victim = f"ps{rnd.randrange(P)}"
    at = _at_step(run, rnd)
    can = _recoverable(run, [victim]) or None
    hit, missed = _kill(run, [victim])
    return _result(f"SIGKILL {hit} at step {at}", can, missed)


def kill_two(run, rnd, P, W):
    pool = _ps(P) + _workers(P, W, chief=True)
    victims = rnd.sample(pool, 2)
    at = _at_step(run, rnd)
    can = _recoverable(run, victims) or None
    hit, missed = _kill(run, victims)  # one of the two is another fault: also a miss
    return _result(f"SIGKILL {hit} together at step {at}", can, missed)


def kill_rejoining(run, rnd, P, W):
    victim = rnd.choice(_workers(P, W))
    at = _at_step(run, rnd)
    first = run.ranks().get(victim)
    _, missed = _kill(run, [victim])
    # Its replacement: a new process of the same name; killed again before it has rejoined.
    run.wait_for(lambda: (p := run.ranks().get(victim)) is not None and p != first, 30, 0.005)
    again, missed_again = _kill(run, [victim])
    if not missed and missed_again:
        missed = f"no replacement of {victim} was seen within 30 s"
    return _result(f"SIGKILL {victim} at step {at}, again while it rejoined ({bool(again)})",
                   True, missed)


def stop_past_timeout(run, rnd, P, W):
    victim = rnd.choice(_workers(P, W, chief=True))
    at = _at_step(run, rnd)
    _, missed = _kill(run, [victim], signal.SIGSTOP)
    time.sleep(TIMEOUT_S + 2)
    run.signal([victim], signal.SIGCONT)
    return _result(f"SIGSTOP {victim} at step {at} for {TIMEOUT_S + 2:.0f} s, then SIGCONT",
                   True, missed)


def kill_in_checkpoint(run, rnd, P, W):
    """A PS killed while a step folder exists without its manifest (files being written)."""
    victim = f"ps{rnd.randrange(P)}"
    start = rnd.randint(15, run.steps - 40)
    run.wait_for(lambda: run.step() >= start, 60)

    def writing() -> bool:
        for step, folder in checkpoint.steps_on_disk(run.ck):
            if not (folder / checkpoint.MANIFEST).exists():
                return True
        return False

    caught = run.wait_for(writing, 20, 0.001)
    can = _recoverable(run, [victim]) or None
    _, missed = _kill(run, [victim])
    if not missed and not caught:
        missed = "no checkpoint write was caught within 20 s (an ordinary PS kill)"
    return _result(f"SIGKILL {victim} at step {run.step()} "
                   f"({'while a checkpoint was being written' if caught else 'no write caught'})",
                   can, missed)


STARTUP_S = 0.2  # a rank's start-up here: from its process name to the first step, 0.2-0.25 s


def kill_at_startup(run, rnd, P, W):
    """A rank killed in its start-up (imports, RPC init, the plan): before the chief has
    logged a step; a kill after that is another fault, and says so."""
    victim = rnd.choice(_ps(P) + _workers(P, W, chief=True))
    run.wait_for(lambda: victim in run.ranks(), 60, 0.005)
    time.sleep(rnd.uniform(0, STARTUP_S))
    can = _recoverable(run, [victim]) or None
    steps = run.step()
    hit, missed = _kill(run, [victim])
    if not missed and steps:
        missed = f"training had begun ({steps} steps)"
    return _result(f"SIGKILL {hit} {steps} steps in, during start-up", can, missed)


def kill_in_eval(run, rnd, P, W):
    """A rank killed while the chief evaluates the final model: once the final checkpoint
    is committed (the chief's last logged step can fall short of train.steps, as in async
    runs where other workers took the last steps), before summary.json. The victim: a worker
    other than the chief, drawn first, or a PS or worker running at that moment."""
    drawn = rnd.choice(_workers(P, W))
    run.wait_for(lambda: run.step() >= run.steps or max(_committed(run), default=0)
                 >= run.steps, 120)
    time.sleep(0.2)  # the chief evaluates 20000 test samples now
    victim = _alive_one(run, rnd, drawn, _workers(P, W) + _ps(P))
    can = True if victim.startswith("worker") else None
    over = (run.out / "summary.json").exists()
    hit, missed = _kill(run, [victim])
    if not missed and over:
        missed = "the final evaluation was over (summary.json written)"
    return _result(f"SIGKILL {hit} during the final evaluation", can, missed)


def kill_in_shutdown(run, rnd, P, W):
    drawn = rnd.choice(_ps(P) + _workers(P, W))
    run.wait_for(lambda: (run.out / "summary.json").exists(), 120, 0.005)
    victim = _alive_one(run, rnd, drawn, _ps(P) + _workers(P, W))
    hit, missed = _kill(run, [victim])
    if not (run.out / "summary.json").exists():
        missed = missed or "no summary.json within 120 s"
    return _result(f"SIGKILL {hit} once summary.json was written", True, missed)


def kill_launcher(run, rnd, P, W):
    at = _at_step(run, rnd)
    missed = "" if run.alive() else f"the run had ended (exit {run.proc.returncode})"
    try:
        os.kill(run.proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        missed = missed or "the launcher was gone"
    return _result(f"SIGKILL the launcher at step {at}", False, missed)


# -- with cluster.ps_replicas (the campaign's replicas=true): nothing may be rolled back ----------
def _new_backups(run: Run, count: int) -> bool:
    """Whether the chief has logged `count` new backups (copies made after failovers)."""
    return run.stderr_path.read_text(errors="replace").count(": a new backup on ") >= count


def kill_ps_replicated(run, rnd, P, W):
    """Any PS, every shard with a backup elsewhere: it fails over, nothing rolled back."""
    victim = f"ps{rnd.randrange(P)}"
    at = _at_step(run, rnd)
    hit, missed = _kill(run, [victim])
    return _result(f"SIGKILL {hit} at step {at}", True, missed)


def kill_ps_twice(run, rnd, P, W):
    """A PS, then, once the shards it held have new backups (copied while training goes on),
    a PS again (the same one started again, or another): two failovers."""
    first = f"ps{rnd.randrange(P)}"
    at = _at_step(run, rnd)
    hit, missed = _kill(run, [first])
    if missed:
        return _result(f"SIGKILL {first} at step {at}", True, missed)
    if not run.wait_for(lambda: _new_backups(run, 1), 60, 0.05):
        return _result(f"SIGKILL {first} at step {at}", True, "no new backup was logged "
                       "within 60 s of the first kill")
    second = rnd.choice(_ps(P))
    at2 = run.step()
    hit2, missed = _kill(run, [second])
    return _result(f"SIGKILL {first} at step {at}, then {hit2} at step {at2} once the shards "
                   "had new backups", True, missed)


def kill_two_ps(run, rnd, P, W):
    """Two PS together, with 2 backups of every shard on 3 PS: a copy of each shard is left."""
    victims = rnd.sample(_ps(P), 2)
    at = _at_step(run, rnd)
    hit, missed = _kill(run, victims)
    return _result(f"SIGKILL {hit} together at step {at}", True, missed)


def _log(run: Run) -> str:
    return run.stderr_path.read_text(errors="replace")


def _count(run: Run, pattern: str) -> int:
    """How many lines of the run's log (every rank's, prefixed [ps0], [worker0], [launcher])
    match `pattern`."""
    return len(re.findall(pattern, _log(run), re.MULTILINE))


def _hold(run: Run, victim: str, at: int, seconds: float) -> tuple:
    """SIGSTOP `victim` (hung, not dead) for `seconds`, then SIGCONT."""
    _, missed = _kill(run, [victim], signal.SIGSTOP)
    time.sleep(seconds)
    run.signal([victim], signal.SIGCONT)
    return _result(f"SIGSTOP {victim} at step {at} for {seconds:g} s, then SIGCONT", True, missed)


def stop_ps(run, rnd, P, W):
    """A PS hung for 0.5 s to update.timeout_s + 3 s, then continued: nothing is lost (past
    the timeout its open round may close without a worker: the summary must say so)."""
    victim, seconds = f"ps{rnd.randrange(P)}", round(rnd.uniform(0.5, TIMEOUT_S + 3), 1)
    return _hold(run, victim, _at_step(run, rnd), seconds)


def stop_worker(run, rnd, P, W):
    """A worker (the chief too) hung for 0.5 s to update.timeout_s + 3 s, then continued."""
    victim = rnd.choice(_workers(P, W, chief=True))
    seconds = round(rnd.uniform(0.5, TIMEOUT_S + 3), 1)
    return _hold(run, victim, _at_step(run, rnd), seconds)


# A primary gives a hung backup up within its acknowledgement bound (10 s) of the first update
# it sends there. Where the hung PS holds a primary too, the workers can be waiting for its
# reply before any other primary has an update for it (the round's other shards already
# answered, a table lookup, a clock's ticket): then no backup is given up while it is hung. So
# each stall lasts at most STALL_TRY_S, well under the workers' RPC timeout (update.timeout_s +
# 60 s); it is tried again (continued, a moment of training, hung again) up to STALL_TRIES
# times, at other moments of the step.
STALL_TRY_S = 15.0
STALL_TRIES = 8


def _gave_up(run: Run, backup: str) -> Optional[str]:
    """The first primary's PS that logged that its backup on `backup` did not take an update."""
    m = re.search(rf"^\[(ps\d+)\][^\n]*its backup on {backup} did not take an update",
                  _log(run), re.MULTILINE)
    return m.group(1) if m else None


def _stall_until_given_up(run: Run, rnd: random.Random, backup: str) -> tuple[Optional[str], str]:
    """SIGSTOP `backup` until a primary gives its backup there up (the PS that did, or None),
    SIGCONT; tried again, at another moment, up to STALL_TRIES times. Also why it missed."""
    for attempt in range(STALL_TRIES):
        _, missed = _kill(run, [backup], signal.SIGSTOP)
        if missed:
            return None, missed
        run.wait_for(lambda: _gave_up(run, backup) is not None, STALL_TRY_S, 0.05)
        run.signal([backup], signal.SIGCONT)
        if _gave_up(run, backup) is not None:
            return _gave_up(run, backup), ""
        time.sleep(rnd.uniform(0.05, 1.0))  # (training goes on a little first)
    return None, (f"no primary logged that its backup on {backup} did not take an update in "
                  f"{STALL_TRIES} stalls of {STALL_TRY_S:g} s")


def stall_backup_then_kill_primary(run, rnd, P, W):
    """A backup's PS hung until a primary gives its backup there up ("did not take an
    update"), continued, then that primary killed: its shards fail over to a copy that took
    every update (a second backup), or, with none, everything rolls back saying so; never to
    the copy that missed updates."""
    backup = f"ps{rnd.randrange(P)}"
    at = _at_step(run, rnd)
    t0 = time.monotonic()
    primary, missed = _stall_until_given_up(run, rnd, backup)
    did = f"SIGSTOP {backup} at step {at}"
    if primary is None:
        return _result(did + " (SIGCONT after each stall)", True, missed)
    hit, missed = _kill(run, [primary])
    return _result(did + f" until {primary} gave its backup there up "
                   f"({time.monotonic() - t0:.1f} s), SIGCONT, then SIGKILL {hit} at step "
                   f"{run.step()}", True, missed)


COPYING = r"copying (\d+) shards to new backups"
COPIED = r": a new backup on "


def kill_in_backup_copy(run, rnd, P, W):
    """A PS killed; once the chief copies shards to new backups on the PS that came back, that
    PS killed again before every copy is made (its copies in progress are lost, nothing else):
    another failover epoch, new copies again."""
    victim = f"ps{rnd.randrange(P)}"
    at = _at_step(run, rnd)
    hit, missed = _kill(run, [victim])
    if missed:
        return _result(f"SIGKILL {victim} at step {at}", True, missed)
    run.wait_for(lambda: _count(run, COPYING) >= 1, 60, 0.002)
    copying = [int(n) for n in re.findall(COPYING, _log(run))]
    done = _count(run, COPIED)
    hit2, missed = _kill(run, [victim])
    did = (f"SIGKILL {victim} at step {at}, again at step {run.step()} with {done} of "
           f"{sum(copying)} new backups made")
    if not missed and not copying:
        missed = "no copy to new backups was logged within 60 s"
    elif not missed and done >= sum(copying):
        missed = "every new backup was made before the second kill"
    return _result(did, True, missed)


EPOCH_BEGUN = r"^\[launcher\].*starting it again .*membership epoch"
EPOCH_DONE = r"membership epoch \d+: .* joined again at step"


def kill_in_epoch(run, rnd, P, W):
    """A PS killed; while the membership epoch that starts it again forms (the launcher has
    announced it, the chief has not logged it joined), a worker killed: one more epoch, not a
    hang, still no copy lost."""
    first, second = f"ps{rnd.randrange(P)}", rnd.choice(_workers(P, W))
    at = _at_step(run, rnd)
    hit, missed = _kill(run, [first])
    if missed:
        return _result(f"SIGKILL {first} at step {at}", True, missed)
    run.wait_for(lambda: _count(run, EPOCH_BEGUN) >= 1, 30, 0.002)
    begun, joined = _count(run, EPOCH_BEGUN), _count(run, EPOCH_DONE)
    hit2, missed = _kill(run, [second])
    if not missed and not begun:
        missed = "the launcher announced no membership epoch within 30 s"
    elif not missed and joined:
        missed = "the epoch had formed before the second kill"
    return _result(f"SIGKILL {first} at step {at}, then {hit2} while its epoch formed", True,
                   missed)


def worker_lost_then_kill_ps(run, rnd, P, W):
    """cluster.max_worker_restarts=0: a worker killed is lost for good (sync rounds go on
    without it after update.timeout_s); a few steps later a PS killed."""
    worker, ps = rnd.choice(_workers(P, W)), f"ps{rnd.randrange(P)}"
    at = _at_step(run, rnd)
    hit, missed = _kill(run, [worker])
    if missed:
        return _result(f"SIGKILL {worker} at step {at}", True, missed)
    run.wait_for(lambda: _count(run, r"the others go on without it") >= 1, 30)
    later = run.step() + 5
    run.wait_for(lambda: run.step() >= later, 30)
    can = _recoverable(run, [ps]) or None
    hit2, missed = _kill(run, [ps])
    if not missed and not _count(run, r"the others go on without it"):
        missed = f"the launcher did not say {worker} was lost for good"
    return _result(f"SIGKILL {worker} at step {at} (lost for good), then {hit2} at step "
                   f"{run.step()}", can, missed)


REPLICA_FAULTS: dict[str, Callable] = {
    "kill_ps": kill_ps, "kill_ps_replicated": kill_ps_replicated,
    "kill_ps_twice": kill_ps_twice, "kill_two_ps": kill_two_ps, "stop_ps": stop_ps,
    "stop_worker": stop_worker, "stall_backup_then_kill_primary": stall_backup_then_kill_primary,
    "kill_in_backup_copy": kill_in_backup_copy, "kill_in_epoch": kill_in_epoch,
    "worker_lost_then_kill_ps": worker_lost_then_kill_ps}
# What each replica fault is drawn with: the cluster.ps_replicas it takes (kill_ps: none, its
# shards roll back to the checkpoint), and overrides of its own (part of its oracle's config).
REPLICA_DRAW: dict[str, tuple[tuple, list]] = {
    "kill_ps": ((0,), []), "kill_ps_replicated": ((1, 2), []), "kill_ps_twice": ((1, 2), []),
    "kill_two_ps": ((2,), []), "stop_ps": ((0, 1, 2), []), "stop_worker": ((0, 1, 2), []),
    # (over TensorPipe every update waits for its acknowledgement: the hung backup is seen)
    "stall_backup_then_kill_primary": ((1, 2), ["cluster.shm=off"]),
    "kill_in_backup_copy": ((1, 2), []), "kill_in_epoch": ((0, 1, 2), []),
    "worker_lost_then_kill_ps": ((0, 1, 2), ["cluster.max_worker_restarts=0"])}
# A fault that cannot happen in a mode, and the mode drawn instead: with bounded staleness every
# push first asks the clock shard for a ticket, so a PS hung with the clock stops every push and
# no primary sends an update its backup could miss (the workers' calls time out instead).
UNDELIVERABLE = {("stall_backup_then_kill_primary", "async-bounded"): "async"}
# Where a run may roll back (steps redone, the summary naming the roll back) with backups:
# every up-to-date copy of a shard lost (a single backup given up, then its primary killed; the
# PS that came back killed again while its new copy is not yet in step: a half-made copy is
# never promoted).
MAY_LOSE_EVERY_COPY = {"stall_backup_then_kill_primary": (1,), "kill_ps_twice": (1,)}

FAULTS: dict[str, Callable] = {
    "kill_worker": kill_worker, "kill_chief": kill_chief, "kill_ps": kill_ps,
    "kill_two": kill_two, "kill_rejoining": kill_rejoining,
    "stop_past_timeout": stop_past_timeout, "kill_in_checkpoint": kill_in_checkpoint,
    "kill_at_startup": kill_at_startup, "kill_in_eval": kill_in_eval,
    "kill_in_shutdown": kill_in_shutdown, "truncated_checkpoint": None,
    "missing_checkpoint_file": None, "full_disk": None, "kill_launcher": kill_launcher,
}
