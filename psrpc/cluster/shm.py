"""Shared memory between a PS and the workers on its host (`cluster.shm`).

When a worker and a PS share a host nothing needs to cross a socket. Each dense shard then has,
in /dev/shm:
- its master copy (`<run>-s<g>-params`): the PS's optimizer updates it in place;
- one gradient slot per worker (`<run>-s<g>-g<w>`): the worker's gradient buffer for that shard
  *is* its slot (its parameters' `.grad` are views into it: backward writes the gradient where
  the PS reads it).
A push is then an RPC carrying only control (`SLOT`: "my slot for this shard is ready", the
version, the loss); the PS reads the slot only after that message, so a worker that dies
mid-write never touches the master copy, and the worker does not write its slot again before
the reply (it waits for the round). Parameters come back without a copy in sync training with
every worker in the round: the worker's parameters are views into the master copy, which no
update touches before every worker of the round has pushed again (after its backward has used
them). With backup workers or async updates the master copy can change while a worker computes,
so its parameters come in the reply, a snapshot, as over TCP.

The segments are files under /dev/shm named after the run (`psrpc-<id>-...`), created by the
PS that holds the shard (asked by the chief, before the shards exist) and registered with
multiprocessing's resource tracker, which removes them if the process is killed. The PS removes
them when it leaves, and the local launcher removes whatever is left of the run at its end. A
PS or worker started again (a membership epoch) maps the same files.
"""

from __future__ import annotations

import glob
import logging
import os
import secrets
import socket
from multiprocessing import resource_tracker
from pathlib import Path
from typing import Optional

import torch

from psrpc.cluster.topology import replicas

log = logging.getLogger("psrpc")
SHM_DIR = Path("/dev/shm")
SLOT = "slot"  # what a push carries instead of a gradient: "read my slot"


def new_run() -> str:
    """A name for a run's segments."""
    return f"{os.getpid()}x{secrets.token_hex(3)}"


def available() -> bool:
    """A shared-memory file system to map segments from (Linux)."""
    return SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK)


def segment(run: str, shard: int, what: str) -> str:
    """The file name of a segment: what = "params", or "g<worker>" for a gradient slot."""
    return f"psrpc-{run}-s{shard}-{what}"


def create(name: str, numel: int) -> None:
    """A zero-filled float32 segment of `numel` elements; removed by the resource tracker if
    every process that could remove it is killed."""
    path = SHM_DIR / name
    fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_TRUNC, 0o600)  # this user's ranks only
    try:
        os.ftruncate(fd, numel * 4)
    finally:
        os.close(fd)
    try:
        resource_tracker.register("/" + name, "shared_memory")
    except Exception:  # no tracker: the launcher's cleanup still removes it
        pass


def attach(name: str, numel: int) -> torch.Tensor:
    """The segment as a float32 tensor of `numel` elements, shared with every process that
    maps it (writes are seen by all)."""
    return torch.from_file(str(SHM_DIR / name), shared=True, size=numel, dtype=torch.float32)


def unlink(name: str) -> bool:
    """Delete one segment (processes that map it keep their mapping); whether it was there."""
    try:
        os.unlink(SHM_DIR / name)
    except FileNotFoundError:
        return False
    try:
        resource_tracker.unregister("/" + name, "shared_memory")
    except Exception:
        pass
    return True


def remove(run: str) -> int:
    """Delete every segment of `run`; returns how many there were."""
    return sum(unlink(os.path.basename(p)) for p in glob.glob(str(SHM_DIR / f"psrpc-{run}-*")))


def mode(cfg, same_host: bool) -> Optional[str]:
    """How a worker and a PS on `same_host` exchange a dense shard: "views" (slots, and the
    worker's parameters are views of the master copy: sync with every worker in each round),
    "slots" (gradients through slots, parameters in the reply), or None (TCP)."""
    setting = cfg.cluster.shm
    if setting == "off" or not same_host or cfg.update.wire_dtype != "float32":
        return None
    if not available():
        if setting == "on":
            log.warning("cluster.shm=on but %s is not writable: using TCP", SHM_DIR)
        return None
    everyone = (cfg.update.name == "sync" and cfg.update.replicas_to_aggregate in
                (None, replicas(cfg)))
    return "views" if everyone else "slots"


def host_id() -> str:
    """Which machine this process runs on: two ranks with the same id share memory."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"
