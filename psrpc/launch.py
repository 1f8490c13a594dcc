"""The local launcher: `python -m psrpc` runs a whole cluster (P + W fresh processes) on 127.0.0.1,
every listener on loopback.

Processes come from a forkserver that has imported torch once (a spawned interpreter pays 4-6 s
for `import torch` on 2 cores; a fork of the clean server pays none), so every run and every
multirun job still gets fresh processes with no RPC state. The parent waits, and:
- a rank that fails (an exception, or a PS or the chief dying) brings the run down at once:
  every child is terminated and the failing rank's error is raised;
- a rank killed by a signal is started again and joins the running job in a new membership
  epoch (psrpc/cluster/membership.py; the deaths seen in one poll make one epoch), within its
  restart budget; a worker beyond it is lost, not fatal: the others go on, and every later
  epoch's group is formed without it (it is listed gone in the store). Once the chief has
  ended training nobody is started again: a rank lost then is lost;
- SIGINT/SIGTERM to the parent: every child gets SIGTERM, the chief stops at its next step and
  commits a final checkpoint, and the launcher waits for every child to leave by itself (up to
  SIGNAL_GRACE_S; a second signal kills them at once). The launcher exits only once every
  process it started is gone, multiprocessing's helpers included.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import shutil
import signal
import socket
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Optional

from psrpc import knobs, spawn
from psrpc.cluster import membership, netif, shm
from psrpc.cluster.store import host_store
from psrpc.cluster.topology import Topology, pipeline_stages
from psrpc.config import Config
from psrpc.errors import ConfigError, PsrpcError

log = logging.getLogger("psrpc")
# User's SIGTERM/SIGINT: how long the chief gets to end its step, commit the final checkpoint
# and write model.pt before every child is killed (a few seconds normally; the final evaluation
# is skipped). torchrun gives 30 s between its SIGTERM and SIGKILL: the same here.
SIGNAL_GRACE_S = 30.0
FAILURE_GRACE_S = 0.0  # a rank failed (or the run timed out): SIGKILL at once, no outputs as if done
# The chief has written the outputs and told every rank to stop: one still there after this long
# is hung (stopped, wedged in a call) and is ended, with a line; the run has succeeded
AFTER_CHIEF_S = 30.0


class ClusterFailed(PsrpcError):
    """A rank failed; the message names it and carries its error."""


def free_port(addr: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def check_port(addr: str, port: int, key: str) -> None:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((addr, port))
        except OSError as e:
            raise ConfigError(f"{key}={port}: port busy on {addr} ({e.strerror}); choose another "
                              f"port, or leave it unset for a free one") from None


def choose_port(cfg: Config) -> int:
    """cluster.port, else MASTER_PORT, else a free port; a busy one is an error."""
    if cfg.cluster.port is not None:
        check_port("127.0.0.1", cfg.cluster.port, "cluster.port")
        return cfg.cluster.port
    if os.environ.get("MASTER_PORT"):
        port = int(os.environ["MASTER_PORT"])
        check_port("127.0.0.1", port, "MASTER_PORT")
        return port
    return free_port()


def local_interface(cfg: Config) -> str:
    """Every rank is on this machine: RPC listens on loopback only, whatever TP_SOCKET_IFNAME or
    GLOO_SOCKET_IFNAME say (they name the interface for torchrun runs)."""
    loopback = netif.loopback_interface()
    named = cfg.cluster.interface
    if named is not None and named != loopback:
        raise ConfigError(f"cluster.interface={named!r}: the local launcher runs every rank on "
                          f"this machine and listens on loopback ({loopback}) only; name an "
                          "interface for torchrun or many-node runs")
    return loopback


def launch(cfg: Config, out_dir: Path, timeout_s: Optional[float] = None,
           replica_cls=None) -> list[str]:
    """Run the cluster to the end. Returns the names of lost workers; raises ClusterFailed.

    `replica_cls` replaces the replica loop (psrpc.worker.data_parallel.Worker) on every
    worker (a module-level class: it is pickled by reference), e.g. to push known gradients in
    a test; its `build_model` builds the model.

    A worker that dies is started again and rejoins the running job (up to
    cluster.max_worker_restarts times each); a PS that dies is started again and every shard
    rolls back to the last committed checkpoint (up to cluster.max_ps_restarts). When the chief
    dies, every process is started again and training resumes from the last committed
    checkpoint, as TensorFlow's MonitoredTrainingSession does (counted in max_ps_restarts too)."""
    P, W = cfg.cluster.num_ps, cfg.cluster.num_workers
    port = choose_port(cfg)
    topo = Topology(P, W, master_addr="127.0.0.1", master_port=port, stages=pipeline_stages(cfg),
                    interface=local_interface(cfg), shm_run=shm.new_run())
    store = host_store("127.0.0.1", port, cfg.cluster.init_timeout_s)
    if cfg.cluster.shm != "off" and shm.available():
        shm.remove_stale()  # runs on this host whose processes are all gone (kill -9 of a run)
        shm.hold(topo.shm_run, "launcher")  # alive for the whole run, while a lone PS restarts
    try:
        return _attempts(cfg, topo, out_dir, replica_cls, store, timeout_s)
    finally:
        shm.remove(topo.shm_run)  # every rank is gone: its shared memory too
        shm.release(topo.shm_run, remove_files=True)


def _attempts(cfg: Config, topo: Topology, out_dir: Path, replica_cls, store,
              timeout_s: Optional[float]) -> list[str]:
    started = time.monotonic()
    attempt = 0
    while True:
        cluster = _Cluster(cfg, topo, out_dir, replica_cls, store, attempt, (started, timeout_s))
        try:
            return cluster.run()
        except _ChiefDied as e:
            if attempt >= cfg.cluster.max_ps_restarts or not cfg.checkpoint.dir:
                why = ("no checkpoint.dir to resume from" if not cfg.checkpoint.dir else
                       f"cluster.max_ps_restarts={cfg.cluster.max_ps_restarts} used up")
                raise ClusterFailed(f"{e} ({why})") from None
            attempt += 1
            shm.remove(topo.shm_run)  # every rank is gone; the new group creates its own (the
            # launcher's lock stays: the run is alive)
            log.warning("%s: starting every process again, training resumes from the last "
                        "checkpoint (restart %d of %d)", e, attempt, cfg.cluster.max_ps_restarts)


class _ChiefDied(ClusterFailed):
    """The chief died: its session is gone, the whole group starts again from a checkpoint."""


class _Cluster:
    """One attempt of the whole group: start every rank, watch them, start lost ones again."""

    def __init__(self, cfg, topo, out_dir, replica_cls, store, attempt, limit):
        self.cfg, self.topo, self.out_dir, self.replica_cls = cfg, topo, out_dir, replica_cls
        self.store, self.attempt = store, attempt
        self.started, self.timeout_s = limit  # the run's start, its time limit (None: none)
        self.ctx = spawn.process_context()
        self.errors = Path(tempfile.mkdtemp(prefix="psrpc-"))  # each rank's one-line error
        self.procs: dict[str, mp.Process] = {}
        self.lost: list[str] = []
        self.epoch = 0
        self.restarts: dict[str, int] = {}
        self.chief_done: Optional[float] = None  # when the chief exited with 0
        membership.open_attempt(store, attempt)

    def _start(self, rank: int) -> None:
        name = self.topo.name_of(rank)
        topo = replace(self.topo.with_rank(rank, self.epoch), restart_count=self.attempt)
        self.procs[name] = self.ctx.Process(target=spawn.child, name=name, daemon=False, args=(
            self.cfg, topo, str(self.out_dir), str(self.errors / f"{name}.err"),
            self.replica_cls, spawn.this_process(), knobs.given()))
        self.procs[name].start()

    def run(self) -> list[str]:
        stop = _Signals()
        try:
            for rank in range(self.topo.world_size):
                self._start(rank)
            running = dict(self.procs)
            while running:
                stop.check()
                if (self.timeout_s is not None
                        and time.monotonic() - self.started > self.timeout_s):
                    raise ClusterFailed(f"the run did not finish within {self.timeout_s:g} s "
                                        "(its time limit); stopped every process")
                failed, killed = [], []
                for name, p in list(running.items()):
                    if p.exitcode is None:
                        continue
                    del running[name]
                    if p.exitcode == 0:
                        continue
                    (killed if p.exitcode < 0 else failed).append(name)
                if killed:  # every death seen at once: one membership epoch for all of them
                    restarted, lost = self._recover(killed)
                    running.update((name, self.procs[name]) for name in restarted)
                    failed += lost
                if failed:
                    raise ClusterFailed(_root_cause(failed, self.procs, self.errors, self.lost))
                if self._hung_after_chief(running):
                    break
                time.sleep(0.05)
            return self.lost
        finally:
            _terminate(self.procs.values(),
                       SIGNAL_GRACE_S if stop.received else FAILURE_GRACE_S, stop)
            stop.restore()
            shutil.rmtree(self.errors, ignore_errors=True)

    def _hung_after_chief(self, running: dict) -> bool:
        """Whether the chief ended well AFTER_CHIEF_S ago and ranks are still there (they are
        then ended: the outputs are written, nothing waits for them)."""
        chief = self.procs[self.topo.chief_name]
        if chief.exitcode != 0 or not running:
            return False
        self.chief_done = self.chief_done or time.monotonic()
        if time.monotonic() - self.chief_done < AFTER_CHIEF_S:
            return False
        log.warning("%s still there %g s after the chief finished (hung or stopped): ending it",
                    ", ".join(sorted(running)), AFTER_CHIEF_S)
        return True

    def _recover(self, names: list[str]) -> tuple[list[str], list[str]]:
        """Ranks killed by a signal: each is started again (one new membership epoch for all
        of them), or lost (a worker the others go on without), or failed. Returns (started
        again, failed); raises _ChiefDied when the chief died. Once the chief has ended
        training nobody is started again: the chief joins no epoch after that, and a rank it
        still needs (a PS for the outputs) fails the chief, which reports it."""
        c, topo = self.cfg.cluster, self.topo
        codes = {name: self.procs[name].exitcode for name in names}
        if topo.chief_name in codes:
            raise _ChiefDied(f"{topo.chief_name} died ({_describe(codes[topo.chief_name])})")
        if membership.training_over(self.store, self.attempt):
            return [], self._after_training(names, codes)
        again, failed = [], []
        for name in names:
            is_worker = name.startswith("worker")
            budget = c.max_worker_restarts if is_worker else c.max_ps_restarts
            can = (self.restarts.get(name, 0) < budget
                   and (self.cfg.parallel.name == "data" if is_worker  # a PS: its shards
                        else bool(self.cfg.checkpoint.dir or c.ps_replicas)))  # come back
            if can:
                again.append(name)
            elif is_worker:
                log.warning("%s died (%s); the others go on without it", name,
                            _describe(codes[name]))
                self.lost.append(name)
            else:
                failed.append(name)
        if failed or not (again or self._regroup(names)):  # a failure ends the run; nobody to
            return [], failed  # start again, and no group to form anew without the lost
        if not membership.announce(self.store, self.attempt, self.epoch + 1, again, self.lost):
            return [], self._after_training(again, codes)  # the chief ended training meanwhile
        self.epoch += 1
        for name in again:
            used = self.restarts[name] = self.restarts.get(name, 0) + 1
            budget = c.max_worker_restarts if name.startswith("worker") else c.max_ps_restarts
            log.warning("%s died (%s); starting it again (restart %d of %d), membership epoch "
                        "%d", name, _describe(codes[name]), used, budget, self.epoch)
            self._start(topo.rank_of(name))
        for other, p in self.procs.items():  # a wake-up only: the store says the epoch
            if other not in again and p.exitcode is None and _handles_wakeup(p.pid):
                try:
                    os.kill(p.pid, signal.SIGUSR1)
                except ProcessLookupError:
                    pass
        return again, []

    def _regroup(self, names: list[str]) -> bool:
        """Whether workers just lost for good need an epoch of their own: under
        update.dense=allreduce the workers share a group, which must form again without
        them (elsewhere the PS stop waiting for a lost worker, and the next epoch leaves it
        out)."""
        return self.cfg.update.dense == "allreduce" and any(n in self.lost for n in names)

    def _after_training(self, names: list[str], codes: dict) -> list[str]:
        for name in names:
            log.warning("%s died (%s) after training ended; not started again", name,
                        _describe(codes[name]))
            self.lost.append(name)
        return []


def _handles_wakeup(pid: int) -> bool:
    """Whether process `pid` has its SIGUSR1 handler installed (/proc says; where there is no
    /proc, the forkserver's SIG_IGN still keeps a rank that has none from being killed)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return not Path("/proc/self/status").exists()
    except OSError:
        return False
    for line in status.splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signal.SIGUSR1 - 1) & 1)
    return True


def _describe(exitcode: int) -> str:
    if exitcode < 0:
        return f"killed by {signal.Signals(-exitcode).name}"
    return f"exit code {exitcode}"


def _root_cause(failed: list[str], procs: dict, errors: Path, lost: list[str]) -> str:
    """The failure to report: a process that died of a signal (the others usually fail because
    of it, moments later) before one that raised; a PS before a worker."""
    time.sleep(0.3)  # let the knock-on failures land, then pick
    failed += [n for n, p in procs.items()
               if n not in failed and n not in lost and p.exitcode not in (None, 0)]
    name = min(failed, key=lambda n: (procs[n].exitcode >= 0, not n.startswith("ps")))
    return _failure(name, procs[name].exitcode, errors / f"{name}.err")


def _failure(name: str, exitcode: int, error_file: Path) -> str:
    text = error_file.read_text().strip() if error_file.exists() else ""
    return f"{name} failed: {text}" if text else f"{name} died ({_describe(exitcode)})"


def _terminate(procs, grace_s: float, signals: "_Signals") -> None:
    """SIGTERM every live child and wait for all of them to leave by themselves (the chief
    commits its final checkpoint, then tells the others to stop); SIGKILL what is left after
    `grace_s` (at once with 0: a failed run writes no outputs as if it had finished), or when
    another signal arrives meanwhile. Returns once every child is gone."""
    alive = [p for p in procs if p.pid is not None and p.exitcode is None]
    for p in alive:
        if grace_s > 0:
            p.terminate()
    deadline = time.monotonic() + grace_s
    seen = signals.count
    while any(p.exitcode is None for p in alive) and time.monotonic() < deadline:
        if signals.count > seen:
            log.warning("second signal: killing every process now")
            break
        time.sleep(0.05)
    for p in alive:
        if p.exitcode is None:
            p.kill()
    for p in alive:
        p.join(5)  # SIGKILL cannot be ignored: this reaps them


class _Signals:
    """SIGINT/SIGTERM while the cluster runs: stop it (the finally-block terminates children)."""

    def __init__(self):
        self.received: Optional[int] = None
        self.count = 0  # signals received so far
        self._old = {}
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (e.g. a test harness): nothing to install
                pass

    def _handle(self, signum, frame) -> None:
        self.received = signum
        self.count += 1

    def check(self) -> None:
        if self.received is not None:
            raise ClusterFailed(f"stopped by {signal.Signals(self.received).name}")

    def restore(self) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)
