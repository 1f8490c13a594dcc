"""How the local launcher's processes are made and how they end: the forkserver every rank is
forked from (it has imported torch and psrpc once), a rank's entry (`child`), a rank leaving
when its launcher is gone, and the helpers stopped at the launcher's exit. Runs in the
launcher (the forkserver, the helpers) and at the start of every rank it forks (`child`).
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
import os
import signal
import threading
import time
import traceback
from multiprocessing import forkserver, resource_tracker
from pathlib import Path
from typing import Optional

import psutil

from psrpc.cluster import membership, shm
from psrpc.cluster.topology import Topology
from psrpc.config import Config
from psrpc import knobs
from psrpc.environment import env_defaults
from psrpc.errors import PsrpcError
from psrpc.process import run_rank

log = logging.getLogger("psrpc")
HELPER_STOP_S = 5.0  # the forkserver and resource tracker leave in milliseconds once told
LAUNCHER_WATCH_S = 0.5  # how often a rank checks that its launcher is still there


def die_with_launcher(pid: int, created: float, shm_run: Optional[str] = None) -> None:
    """Leave at once when the launcher is gone (even killed with SIGKILL): no rank trains on as
    an orphan, and the run's shared memory (`shm_run`) goes with it. The ranks' parent is
    multiprocessing's forkserver, which itself stays until every rank has left, so the
    parent-death signal cannot do this; a thread watches the launcher's pid (and its start
    time, so a reused pid does not count)."""
    def watch():
        while True:
            time.sleep(LAUNCHER_WATCH_S)
            try:
                alive = psutil.Process(pid).create_time() == created
            except psutil.NoSuchProcess:
                alive = False
            if not alive:
                log.error("the launcher (pid %d) is gone; leaving", pid)
                if shm_run:  # the run is over: every rank removes what is left, the first wins
                    shm.remove(shm_run)
                os._exit(1)

    threading.Thread(target=watch, name="psrpc-launcher-watch", daemon=True).start()


def child(cfg: Config, topo: Topology, out_dir: str, error_file: str, replica_cls,
           launcher: tuple[int, float], tuning: dict[str, str]) -> None:
    """Entry of one rank's process (`launcher`: the launcher's pid and start time; `tuning`:
    the knobs set in its environment, psrpc/knobs.py, which a forkserver started earlier
    would not pass on)."""
    knobs.adopt(tuning)
    membership.install_wakeup()  # first: until now SIGUSR1 was ignored (forkserver_preload)
    die_with_launcher(*launcher, topo.shm_run)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher decides; Ctrl-C reaches it
    try:
        run_rank(cfg, topo, Path(out_dir), replica_cls)
    except membership.TrainingOver as e:  # the run is over: nothing failed
        log.warning("%s; leaving", e)
    except BaseException as e:  # report once, then exit non-zero
        if isinstance(e, PsrpcError):  # bad input or a lost peer: the message says it all
            logged = line = str(e)
        else:  # a bug: the traceback goes to this rank's log, one line to the launcher
            logged = traceback.format_exc().rstrip()
            line = f"{type(e).__name__}: {e} (traceback in its log)"
        log.error("%s", logged)
        Path(error_file).write_text(line)
        os._exit(1)


def process_context():
    """The forkserver every psrpc process comes from (benchmarks start their peers from it too)."""
    ctx = mp.get_context("forkserver")
    # torch._dynamo: the first optimizer a PS builds imports it (about 1 s on 2 cores, per rank)
    # psrpc.cluster.forkserver_preload: the ranks ignore SIGUSR1 until they handle it;
    # psrpc.process: every role's code
    ctx.set_forkserver_preload(["psrpc.cluster.forkserver_preload", "psrpc.process",
                                "torch._dynamo"])
    with env_defaults():  # the server and every rank forked from it; not this process
        forkserver.ensure_running()
    if not _HELPERS_STOP_AT_EXIT:
        _HELPERS_STOP_AT_EXIT.append(True)
        atexit.register(stop_helpers)
    return ctx


_HELPERS_STOP_AT_EXIT: list[bool] = []


def stop_helpers() -> None:
    """Stop multiprocessing's forkserver and resource tracker, the launcher's own children, and
    wait for them (at exit: they are shared by every run and multirun job of this process).
    Left alone they leave only after the launcher has gone. multiprocessing has no public
    call for this: its private `_stop` when present, bounded; a helper still there is killed."""
    for helper, pid_attr in ((getattr(forkserver, "_forkserver", None), "_forkserver_pid"),
                             (getattr(resource_tracker, "_resource_tracker", None), "_pid")):
        pid, stop = getattr(helper, pid_attr, None), getattr(helper, "_stop", None)
        if pid is None or stop is None:
            continue
        waiter = threading.Thread(target=stop, daemon=True)  # os.waitpid has no timeout
        waiter.start()
        waiter.join(HELPER_STOP_S)
        if waiter.is_alive():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            waiter.join(HELPER_STOP_S)


def this_process() -> tuple[int, float]:
    return os.getpid(), psutil.Process().create_time()
