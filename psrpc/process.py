"""One rank's life: setup (logging, threads, seed, RPC), its role, and the mirror-image shutdown.

Training loops receive built objects and never call init_rpc. The chief ends the run: it tells
every other process to stop (`stop_serving`), then all leave the RPC group together (graceful
when nobody was lost; torch's graceful shutdown waits for every peer with no way out).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch

from psrpc import knobs
from psrpc.cluster import comm, membership, partitions, shm, store
from psrpc.cluster.comm import rpc_timeout_s
from psrpc.cluster.topology import Topology
from psrpc.config import Config
from psrpc.errors import PsrpcError, Retryable, first_line, one_of
from psrpc.ps import service
from psrpc.session import chief
from psrpc.session.chief import STOP_WAIT_S, Chief
from psrpc.worker.data_parallel import Worker
from psrpc.worker.pipeline import PipelineLeader
from psrpc.worker.replica import MEMBERSHIP_GRACE_S, await_change

log = logging.getLogger("psrpc")

_STOP = threading.Event()
_WAKE = threading.Event()  # the serving loop's: a stop, or a membership change
_GRACEFUL = [True]
_TERMINATING: list[float] = []  # when SIGTERM/SIGINT arrived
PING_EVERY_S = 5.0
# After SIGTERM, how long a PS or worker waits for the chief's stop. While the chief still
# trains it gets STOP_WAIT_S (psrpc/session/chief.py) to end its step; a chief stuck longer (say at a sync barrier for a
# dead worker) is left, so that it fails and the launcher or torchrun can restart the group.
# Once the chief is finishing, its final checkpoint and model.pt need the shards (and the
# pipeline stages' buffers): no rank leaves first. TERMINATE_WAIT_S is longer than the local
# launcher's SIGNAL_GRACE_S and torchrun's 30 s, so those decide, not this timer. A chief that
# stops answering ends the wait at once.
TERMINATE_WAIT_S = 60.0


def stop_serving(graceful: bool) -> None:
    """Called by the chief over RPC when the run is over: this rank leaves the group."""
    _GRACEFUL[0] = graceful
    _STOP.set()
    _WAKE.set()


class _RankFormatter(logging.Formatter):
    """`[worker0] message` for INFO, `[worker0] WARNING: message` otherwise."""

    def __init__(self, rank_name: str, with_time: bool):
        super().__init__()
        t = "%(asctime)s " if with_time else ""
        self._info = logging.Formatter(f"{t}[{rank_name}] %(message)s", "%H:%M:%S")
        self._other = logging.Formatter(f"{t}[{rank_name}] %(levelname)s: %(message)s", "%H:%M:%S")

    def format(self, record: logging.LogRecord) -> str:
        return (self._info if record.levelno == logging.INFO else self._other).format(record)


def name_process(name: str) -> None:
    """What ps, top, pgrep and /proc/<pid>/comm show for this process (Linux: 15 characters),
    so that a user or an operator's script can find and signal a given rank."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(15, ctypes.create_string_buffer(name.encode()[:15]), 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):  # not Linux: the name stays python
        pass


def setup_logging(rank_name: str, out_dir: Path | None) -> None:
    """Console lines prefixed with the rank's name; a log file per rank (never shared)."""
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    console = logging.StreamHandler(sys.stderr)
    console.setFormatter(_RankFormatter(rank_name, with_time=False))
    root.addHandler(console)
    if out_dir is not None:
        (out_dir / "logs").mkdir(parents=True, exist_ok=True)
        file = logging.FileHandler(out_dir / "logs" / f"{rank_name}.log")
        file.setFormatter(_RankFormatter(rank_name, with_time=True))
        root.addHandler(file)
    root.setLevel(logging.INFO)


def set_threads(cfg: Config, topo: Topology) -> int:
    """Workers share the node's cores; a PS needs few (its optimizer step is one flat op)."""
    if topo.role == "ps":
        n = knobs.PS_THREADS.get()
    else:
        n = cfg.cluster.worker_threads or max(1, (os.cpu_count() or 1) // topo.workers_on_this_node)
    torch.set_num_threads(n)
    return n


def set_tf32(tf32) -> None:
    """train.tf32 for the CUDA kernels of this process: TensorFloat-32 (10-bit mantissa, several
    times faster on Ampere and later) in matmuls and cuDNN convolutions, or neither (full
    float32, what a comparison with CPU workers needs); None keeps torch's defaults (cuDNN
    convolutions in TF32, matmuls not). Nothing here touches CUDA itself."""
    if tf32 is not None:
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32


def _on_terminate(signum, frame) -> None:
    """First SIGTERM/SIGINT: the chief ends training at the next step with a final checkpoint,
    the others wait for its stop; a second one exits at once."""
    if _TERMINATING:
        os._exit(128 + signum)
    _TERMINATING.append(time.monotonic())
    membership.stop()
    chief.stop_at_next_step()


def install_signal_handlers() -> None:
    signal.signal(signal.SIGTERM, _on_terminate)
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:  # the local launcher owns Ctrl-C
        signal.signal(signal.SIGINT, _on_terminate)


def run_rank(cfg: Config, topo: Topology, out_dir: Path, replica_cls=None) -> None:
    """Everything one rank does, from joining the cluster to leaving it."""
    replica_cls = replica_cls or replica_class(cfg.parallel.name)
    name_process(f"psrpc-{topo.name}")
    setup_logging(topo.name, out_dir)
    log.info("%s is pid %d (process name psrpc-%s)", topo.name, os.getpid(), topo.name)
    install_signal_handlers()
    if knobs.given():
        log.info("tuning from the environment: %s",
                 " ".join(f"{k}={v}" for k, v in knobs.given().items()))
    set_threads(cfg, topo)
    set_tf32(cfg.train.tf32)
    torch.manual_seed(cfg.train.seed)

    def join(epoch: int, abort=None, rank: int = topo.rank,
             world_size: int = topo.world_size) -> None:
        """Join epoch `epoch`'s RPC group as its member `rank` of `world_size` (fewer than
        every rank once a worker is gone for good: psrpc/cluster/membership.py)."""
        comm.init(topo.name, rank, world_size, topo.master_addr, topo.master_port,
                  rpc_timeout_s=rpc_timeout_s(cfg), init_timeout_s=cfg.cluster.init_timeout_s,
                  attempt=topo.restart_count, interface=topo.interface,
                  agent_store=topo.agent_store, epoch=epoch, abort=abort)

    if topo.role == "ps" and topo.shm_run and cfg.cluster.shm != "off" and shm.available():
        shm.hold(topo.shm_run, topo.name)  # this run is alive on this host while this PS is
    # the store first: where the local launcher announces membership epochs
    store.connect_store(topo.master_addr, topo.master_port, topo.rank, topo.world_size,
                       cfg.cluster.init_timeout_s, topo.agent_store)
    membership.setup(topo.epoch, topo.restart_count, join, topo.rank,
                     [topo.name_of(r) for r in range(topo.world_size)], cfg.cluster.init_timeout_s)
    partitions.watch()  # under torchrun and srun: the ranks announce epochs
    partitions.started_again(topo.is_chief)  # (and a rank started again announces one)
    membership.enter()  # the newest epoch, not necessarily the one it was started for
    graceful = False
    try:
        if topo.is_chief:
            graceful = _run_chief(cfg, topo, out_dir, replica_cls)
        else:
            if topo.is_leader:  # a pipeline stage other than 0 only serves its Stage object
                _run_worker(cfg, topo, replica_cls)
            graceful = _wait_for_stop(topo)
    finally:
        comm.shutdown(graceful=graceful)
        service.remove_segments()  # the workers are gone or leaving: a mapped segment stays mapped


def replica_class(parallel: str):
    """The training loop each replica leader runs, by `parallel=` (a registry, not an if)."""
    return one_of({"data": Worker, "model": PipelineLeader}, parallel, "parallel")


def _run_chief(cfg: Config, topo: Topology, out_dir: Path, replica_cls) -> bool:
    session = Chief(cfg, topo, out_dir, replica_cls)
    session.run()
    lost = {f"worker{w}" for w in session.lost}
    peers = [n for n in topo.ps_names + topo.worker_names[1:] if n not in lost]
    # Graceful only when every peer is there: torch's graceful shutdown waits for each one
    # (a worker can die after its done report, during the final evaluation say)
    answers = dict(zip(peers, _answer(peers)))
    graceful = not session.lost and all(answers.values())
    for name, fut in [(n, comm.call(n, stop_serving, (graceful,), timeout_s=10))
                      for n in peers if answers[n]]:
        try:
            fut.wait()
        except Exception as e:  # it is leaving anyway; shutdown below does not wait for it
            log.warning("%s did not acknowledge the stop: %s", name, first_line(e))
    return graceful


def _answer(peers: list[str]) -> list[bool]:
    """Whether each peer still answers an RPC (all asked at once)."""
    futures = [comm.call(n, chief.ping, timeout_s=5) for n in peers]
    answers = []
    for name, fut in zip(peers, futures):
        try:
            fut.wait()
            answers.append(True)
        except Exception:
            log.warning("%s does not answer: leaving without it", name)
            answers.append(False)
    return answers


def fetch_plan(cfg: Config, topo: Topology, epoch: int):
    """The chief's plan for membership epoch `epoch` (it answers once the shards are ready)."""
    try:
        plan = comm.call_sync(topo.chief_name, chief.get_plan, (epoch,),
                              timeout_s=cfg.cluster.init_timeout_s)
    except Exception as e:  # (the chief gone or not there yet: started again, this rank asks again)
        raise Retryable(
            f"{topo.name}: no plan from the chief ({topo.chief_name}) after waiting up to "
            f"{cfg.cluster.init_timeout_s:.0f} s (cluster.init_timeout_s) for it to initialise "
            f"the parameter servers: {first_line(e)}") from e
    if isinstance(plan, BaseException):  # the chief's start failed: the reply carries why
        raise PsrpcError(f"{topo.name}: the chief could not start the run: {first_line(plan)}")
    return plan


def _run_worker(cfg: Config, topo: Topology, replica_cls) -> None:
    while True:  # the plan of the epoch this rank is in (that epoch can end before it comes)
        try:
            plan = fetch_plan(cfg, topo, membership.current())
            break
        except PsrpcError as e:  # (no plan: the chief failed, or died; no epoch to ask for)
            await_change(e, may_ask=False)  # raises unless a membership change explains it
            membership.rejoin()
    worker = replica_cls(cfg, topo, plan)
    worker.plan_source = lambda epoch: fetch_plan(cfg, topo, epoch)
    worker.run()
    while True:
        try:
            comm.call_sync(topo.chief_name, chief.report_done, (topo.index, vars(worker.stats)))
            break
        except Exception as e:
            await_change(e)
            membership.rejoin()


def _wait_for_stop(topo: Topology) -> bool:
    """Serve RPCs until the chief says stop; give up if the chief stops answering."""
    membership.wake_on_change(_WAKE)
    while not _STOP.is_set():
        _WAKE.wait(1.0 if _TERMINATING else PING_EVERY_S)
        _WAKE.clear()
        if _STOP.is_set():
            break
        if membership.changing():  # a rank was started again: join the new group at once
            membership.rejoin()
            continue
        try:
            phase = comm.call_sync(topo.chief_name, chief.ping, timeout_s=PING_EVERY_S * 2)
        except Exception as e:
            # Training over: the chief has left (it counted this rank lost, hung past the
            # end, and sent it no stop). Nothing failed.
            if membership.ended():
                raise membership.TrainingOver(f"{topo.name}: training ended while it waited "
                                              f"for the chief's stop ({first_line(e)})") from e
            # The chief left the old group for a new epoch's while the ping was under way
            # (the announcement reaches the ranks one by one): join that epoch too. Started
            # again by its engine, the chief marks the attempt failed: stop with its line.
            if partitions.chief_lost(MEMBERSHIP_GRACE_S):
                membership.rejoin()
                continue
            raise Retryable(f"{topo.name}: lost contact with the chief ({topo.chief_name}): "
                             f"{first_line(e)}") from e
        if _TERMINATING and not _STOP.is_set():
            limit = TERMINATE_WAIT_S if phase == "finishing" else STOP_WAIT_S
            if time.monotonic() - _TERMINATING[0] > limit:
                log.warning("no stop from the chief (%s) %.0f s after the signal; leaving",
                            phase, limit)
                return False
    if not _GRACEFUL[0]:
        time.sleep(0.2)  # let the stop's acknowledgement leave before the agent goes down
    return _GRACEFUL[0]
