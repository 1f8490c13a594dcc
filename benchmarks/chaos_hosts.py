"""The fault campaign's host faults (benchmarks/chaos.py runs them with the others): a run as
srun-style tasks, one rank per emulated host (benchmarks/hosts.py), and what a cluster of
machines gets that one machine does not: a host cut off by the network and healed, a slow
link, a host that loses power (started again by an engine that restarts one rank at a time,
as Kubernetes does with `restartPolicy: OnFailure`, or not), the chief's host and the
rendezvous store's host lost.

`HostRun` answers what the campaign's checks ask of `chaos_faults.Run` (its exit, its log,
its step, what it left behind); the processes and /dev/shm it looks at are those of its own
hosts, which are torn down after the checks.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import psutil

from benchmarks import hosts as emulated
from benchmarks.chaos_faults import TIMEOUT_S, Run, _at_step, _recoverable, _result

RPC_TIMEOUT_S = 6.0  # cluster.rpc_timeout_s of a host run: a cut longer than it fails calls
OVERRIDES = ["cluster.interface=eth1", f"cluster.rpc_timeout_s={RPC_TIMEOUT_S:g}",
             "cluster.worker_threads=1"]


def _env() -> dict:
    """This process's environment without what would name another launcher or job."""
    return {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in (
        "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}


class _Tasks:
    """The job's exit as `Run.proc` gives it: over once every task on a live host has ended;
    its code is 0 when each of those ended with 0, else the first other code."""

    def __init__(self, run: "HostRun"):
        self.run = run

    def _live(self) -> list[subprocess.Popen]:
        return [p for k, p in self.run.tasks.items() if k not in self.run.down]

    def poll(self) -> Optional[int]:
        codes = [p.poll() for p in self._live()]
        if None in codes:
            return None
        return next((c for c in codes if c != 0), 0)

    @property
    def returncode(self) -> Optional[int]:
        return self.poll()

    @property
    def pid(self) -> int:
        return self.run.tasks[0].pid

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while (code := self.poll()) is None:
            if time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired("psrpc tasks", timeout)
            time.sleep(0.2)
        return code


class HostRun(Run):
    """`python -m psrpc` as srun starts it, task k (rank k: the PS first, then the workers) on
    emulated host k, every task's stderr in one file. `n` hosts."""

    def __init__(self, folder: Path, overrides: list[str], steps: int, n: int):
        self.folder, self.steps, self.n = folder, steps, n
        self.out, self.ck = folder / "out", folder / "ck"
        folder.mkdir(parents=True, exist_ok=True)
        self.stderr_path = folder / "stderr.txt"
        self.args = [*overrides, *OVERRIDES, f"train.steps={steps}", f"checkpoint.dir={self.ck}",
                     f"out_dir={self.out}"]
        self.job = random.randrange(100000, 200000)
        self.hosts = emulated.Hosts(n).__enter__()
        self.down: set[int] = set()  # hosts powered off and not started again
        self.tasks: dict[int, subprocess.Popen] = {}
        try:
            for k in range(n):
                self.start(k)
        except BaseException:
            self.hosts.close()
            raise
        self.proc = _Tasks(self)
        self.sid = -1  # no session of its own: `session` looks in its hosts
        self.started = time.monotonic()

    def start(self, k: int) -> subprocess.Popen:
        """Task k on host k with the variables srun sets (again: the same environment)."""
        env = {**_env(), "SLURM_JOB_ID": str(self.job), "SLURM_STEP_ID": "0",
               "SLURM_PROCID": str(k), "SLURM_LOCALID": "0", "SLURM_NODEID": str(k),
               "SLURM_NTASKS": str(self.n), "SLURM_TASKS_PER_NODE": f"1(x{self.n})",
               "SLURM_NODELIST": f"h[0-{self.n - 1}]", "SLURM_STEP_NODELIST": f"h[0-{self.n - 1}]",
               "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
        with open(self.stderr_path, "a") as err:
            self.tasks[k] = self.hosts.popen(k, [sys.executable, "-m", "psrpc", *self.args],
                                             cwd=self.folder, stdout=subprocess.DEVNULL,
                                             stderr=err, env=env)
        self.down.discard(k)
        return self.tasks[k]

    def power_off(self, k: int, start_again_after_s: Optional[float] = None) -> None:
        """Host k loses power; with `start_again_after_s`, it boots and its task is started
        again that long after (an engine restarting one rank), else it stays down."""
        self.hosts.power_off(k)
        self.down.add(k)
        if start_again_after_s is not None:
            time.sleep(start_again_after_s)
            self.hosts.power_on(k)
            self.start(k)

    def ranks(self) -> dict[str, psutil.Process]:
        return {}  # (signals reach a host's ranks through its faults, not by name)

    def session(self) -> list[psutil.Process]:
        """Every process still running on its hosts but their init."""
        left = []
        for k in range(self.n):
            if k not in self.hosts._holders:
                continue
            holder = self.hosts._holders[k].pid
            keep = {holder, self.hosts._init_pid(k)}
            pids = emulated._run("ip", "netns", "pids", self.hosts.ns(k), check=False).split()
            for pid in map(int, pids):
                try:
                    p = psutil.Process(pid)
                    if pid not in keep and p.status() != psutil.STATUS_ZOMBIE:
                        left.append(p)
                except psutil.Error:
                    continue
        return left

    def segments(self) -> list[str]:
        """What psrpc left in the /dev/shm of its hosts that are up."""
        found = []
        for k in range(self.n):
            if k in self.hosts._holders:
                out = self.hosts.run(k, ["sh", "-c", "ls -A /dev/shm/psrpc-* 2>/dev/null"])
                found += [f"h{k}:{x}" for x in out.stdout.split() if x and not x.endswith(":")]
        return found

    def kill_all(self) -> None:
        self.hosts.close()  # every process of every host with it


# -- the faults --------------------------------------------------------------------------------
# As chaos_faults' faults: (what it did, whether the run can finish, whether it happened).
# Ranks by task: ps0..ps{P-1} on hosts 0..P-1 (task 0 hosts the store), the chief on host P.

def _worker_host(rnd: random.Random, P: int, W: int) -> int:
    return P + rnd.randrange(1, W)  # a worker's host, not the chief's


def _running(run: HostRun, at: int) -> str:
    return "" if run.alive() else f"the run had ended (exit {run.proc.returncode}) at step {at}"


def _cut(run, rnd, P, W, seconds: float, why: str = ""):
    """A worker host cut off at a random step for `seconds`, then healed."""
    k = _worker_host(rnd, P, W)
    at = _at_step(run, rnd)
    missed = _running(run, at)
    run.hosts.partition(k)
    time.sleep(seconds)
    run.hosts.heal(k)
    return _result(f"h{k} cut off at step {at} for {seconds:g} s{why}, then healed", True,
                   missed)


def host_cut_short(run, rnd, P, W):
    return _cut(run, rnd, P, W, TIMEOUT_S - 1)


def host_cut_long(run, rnd, P, W):
    return _cut(run, rnd, P, W, RPC_TIMEOUT_S + 3, " (past cluster.rpc_timeout_s)")


def host_slow_link(run, rnd, P, W):
    k = _worker_host(rnd, P, W)
    at = _at_step(run, rnd)
    missed = _running(run, at)
    run.hosts.set_rate(k, 2)
    time.sleep(TIMEOUT_S + 2)
    run.hosts.set_rate(k, None)
    return _result(f"h{k}'s link at 2 Mbit/s from step {at} for {TIMEOUT_S + 2:g} s", True,
                   missed)


def _lost(run, rnd, P, W, again_s):
    """A worker host lost at a random step; its task started again `again_s` later (None:
    never)."""
    k = _worker_host(rnd, P, W)
    at = _at_step(run, rnd)
    missed = _running(run, at)
    run.power_off(k, start_again_after_s=again_s)
    then = "not started again" if again_s is None else f"its task started again {again_s:g} s later"
    return _result(f"h{k} (worker{k - P}) lost at step {at}, {then}", True, missed)


def host_lost_worker(run, rnd, P, W):
    return _lost(run, rnd, P, W, None)


def host_lost_worker_restarted(run, rnd, P, W):
    return _lost(run, rnd, P, W, 2)


def host_lost_ps_restarted(run, rnd, P, W):
    k = P - 1  # (P is 2: ps1's host, not the store's)
    at = _at_step(run, rnd)
    missed = _running(run, at)
    can = _recoverable(run, [f"ps{k}"]) or None
    run.power_off(k, start_again_after_s=2)
    return _result(f"h{k} (ps{k}) lost at step {at}, its task started again 2 s later", can,
                   missed)


def host_lost_chief_restarted(run, rnd, P, W):
    at = _at_step(run, rnd)
    missed = _running(run, at)
    run.power_off(P, start_again_after_s=2)
    return _result(f"h{P} (the chief) lost at step {at}, its task started again 2 s later",
                   False, missed)


def host_lost_store(run, rnd, P, W):
    at = _at_step(run, rnd)
    missed = _running(run, at)
    run.power_off(0)
    return _result(f"h0 (ps0 and the rendezvous store) lost at step {at}", False, missed)


HOST_FAULTS = {
    "host_cut_short": host_cut_short, "host_cut_long": host_cut_long,
    "host_slow_link": host_slow_link, "host_lost_worker": host_lost_worker,
    "host_lost_worker_restarted": host_lost_worker_restarted,
    "host_lost_ps_restarted": host_lost_ps_restarted,
    "host_lost_chief_restarted": host_lost_chief_restarted, "host_lost_store": host_lost_store,
}

