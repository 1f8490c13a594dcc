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
so its parameters come in the reply, a snapshot, as over TCP. With cluster.ps_replicas a
primary also makes a ring (`<run>-s<g>-ring<random>`) for each backup on its host, where a large
shard's averaged gradient waits for the backup (psrpc/ps/ring.py).

The segments are files in this user's private directory, /dev/shm/psrpc-<uid> (mode 0700,
psrpc/cluster/shmdir.py), named after the run (`psrpc-<run>-...`), created by the PS that holds
the shard (asked by the chief, before the shards exist). The PS removes them when it leaves, the
local launcher removes whatever is left of the run at its end, and a rank whose launcher is gone
removes the run's files before it leaves. A PS or worker started again (a membership epoch) maps
the same files. Every process that keeps the run alive on the host holds a lock file there
(shmdir.py); a run whose locks are all free is dead, and the next run removes its files.

Nothing found there is trusted: a segment is created exclusively (O_EXCL | O_NOFOLLOW, mode
0600: a file or symlink already there is an error, never truncated or followed), and mapped only
after checking that it is a regular file of this user, 0600, of the expected size, through the
descriptor that was checked (no second lookup of the name). The PS writes a random nonce into
each new segment, and the chief asks every worker to read it back before the plan uses shared
memory: a worker that sees another file, or none (a container with the same host name and boot
id but its own /dev/shm), uses TCP instead (or, with cluster.shm=on, the run stops with the
reason).
"""

from __future__ import annotations

import contextlib
import logging
import os
import platform
import secrets
import socket
import stat
import struct
from pathlib import Path
from typing import Optional

import torch

from psrpc.cluster.shmdir import (available, directory, held, hold, problem, release, remove,
                                  remove_stale, unlink)
from psrpc.cluster.topology import in_lockstep
from psrpc.errors import PsrpcError

__all__ = ["available", "directory", "held", "hold", "problem", "release", "remove",
           "remove_stale", "unlink"]  # (where the segments live: shmdir.py)
log = logging.getLogger("psrpc")
SLOT = "slot"  # what a push carries instead of a gradient: "read my slot"
# What a push carries when the worker's gradient was computed across an update of a master copy
# it reads in place (see `WriteSeq`): "discard my gradient of this step" (sync rounds only).
VOID = "void"
SEQ_ELEMS = 16  # after a master copy, 64 bytes: its write sequence (one int64), then padding
NONCE_BYTES = 16
# Machines whose memory ordering the seqlock (`writing`) relies on: stores are seen in order (TSO)
ORDERED = ("x86_64", "amd64", "i386", "i486", "i586", "i686")


class SegmentProblem(PsrpcError):
    """A segment is not what its PS created (or not there): this rank cannot share memory."""


def new_run() -> str:
    """A name for a run's segments."""
    return f"{os.getpid()}x{secrets.token_hex(3)}"


def segment(run: str, shard: int, what: str) -> str:
    """The file name of a segment: what = "params", or "g<worker>" for a gradient slot."""
    return f"psrpc-{run}-s{shard}-{what}"


def create(name: str, numel: int, nonce: bytes) -> None:
    """A new float32 segment of `numel` elements, this user's only (0600), with `nonce` in its
    first bytes (overwritten once the shard fills it); an error if the name exists at all (a
    file, or a symlink planted to make psrpc truncate another file). The run's lock files say
    when nobody is left to remove it (shmdir.py)."""
    if (why := problem()) is not None:
        raise PsrpcError(f"cannot create shared memory: {why}")
    path = directory() / name
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        raise PsrpcError(f"{path} already exists: a shared-memory segment psrpc was about to "
                         "create (another user's file, or a planted one); psrpc never reuses "
                         "or truncates it. Remove it, or run with cluster.shm=off") from None
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        os.ftruncate(fd, max(numel * 4, len(nonce)))
        os.pwrite(fd, nonce, 0)
    finally:
        os.close(fd)


def _open_checked(name: str, numel: int) -> int:
    """A descriptor of segment `name`, after checking it is what psrpc created: a regular file
    (not a symlink), owned by this user, mode 0600, `numel` float32 elements. Raises
    SegmentProblem saying what is wrong."""
    path = directory() / name
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise SegmentProblem(f"{path} does not exist here (another /dev/shm?)") from None
    except OSError as e:  # ELOOP: a symlink
        raise SegmentProblem(f"{path} cannot be opened safely ({e.strerror})") from None
    st = os.fstat(fd)
    problem = (None if stat.S_ISREG(st.st_mode) else "is not a regular file") or (
        None if st.st_uid == os.geteuid() else f"belongs to uid {st.st_uid}") or (
        None if stat.S_IMODE(st.st_mode) == 0o600 else
        f"has mode {stat.S_IMODE(st.st_mode):o}, not 600") or (
        None if st.st_size >= numel * 4 else f"holds {st.st_size} bytes, not {numel * 4}")
    if problem:
        os.close(fd)
        raise SegmentProblem(f"{path} {problem}")
    return fd


def check(name: str, numel: int, nonce: bytes) -> None:
    """On a worker, before the plan uses shared memory: segment `name` is the one its PS
    created (checked as `attach` checks it, and holding the PS's nonce)."""
    fd = _open_checked(name, numel)
    try:
        seen = os.pread(fd, len(nonce), 0)
    finally:
        os.close(fd)
    if seen != nonce:
        raise SegmentProblem(f"{directory() / name} is not the PS's (its nonce differs: another "
                             "/dev/shm with the same host name and boot id?)")


def check_all(segments: list[tuple[str, int, bytes]], run: Optional[str] = None,
              who: Optional[str] = None) -> Optional[str]:
    """Called by the chief on a worker with (name, elements, its PS's nonce) of each segment the
    worker would map: None when every one checks out here, else why not. With `run` and `who`
    (the worker's name) the worker then keeps the run alive on this host while it lives (a PS
    being started again leaves it a live run)."""
    try:
        for name, numel, nonce in segments:
            check(name, numel, nonce)
        if run is not None and who is not None:
            hold(run, who)
    except (PsrpcError, OSError) as e:  # (a lock: another process of that name holds it)
        return str(e)
    return None


def attach(name: str, numel: int) -> torch.Tensor:
    """The segment as a float32 tensor of `numel` elements, shared with every process that
    maps it (writes are seen by all); mapped through the descriptor that was checked."""
    fd = _open_checked(name, numel)
    try:
        return torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=numel,
                               dtype=torch.float32)
    finally:
        os.close(fd)


def is_marker(payload, marker: str) -> bool:
    """Whether a push's payload is the string `marker` (SLOT, VOID), not a tensor."""
    return isinstance(payload, str) and payload == marker


def master_numel(numel: int) -> int:
    """Elements of the segment of a master copy of `numel` elements (its write sequence
    follows it)."""
    return numel + SEQ_ELEMS


def attach_master(name: str, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A master copy's segment: (its `numel` float32 elements, its write sequence: a one-element
    int64 tensor in the same segment, see `writing`)."""
    whole = attach(name, master_numel(numel))
    at = numel + numel % 2  # 8-byte aligned
    return whole[:numel], whole[at:at + 2].view(torch.int64)


@contextlib.contextmanager
def writing(seq: Optional[torch.Tensor]):
    """A seqlock around an in-place write of a master copy (under the shard's lock): the
    sequence is odd while it is written and even, and different, afterwards. A worker whose
    parameters are views of the master copy reads the sequence when it takes them (`load`) and
    again before each push (`FlatModel.intact`): a different or odd value means an update ran
    while it computed (a round closed without it: update.timeout_s), and its gradient is
    discarded instead of pushed (`VOID`). Stores to one word: on x86 (TSO) a reader that sees
    the same even value before and after read a whole version of the copy. None: no-op."""
    if seq is None:
        yield
        return
    seq.add_(1)
    try:
        yield
    finally:
        seq.add_(1)


def mode(cfg, same_host: bool, machine: Optional[str] = None) -> Optional[str]:
    """How a worker and a PS on `same_host` exchange a dense shard: "views" (slots, and the
    worker's parameters are views of the master copy: sync with every worker in each round),
    "slots" (gradients through slots, parameters in the reply), or None (TCP). `machine`: the
    host's processor (platform.machine() of the PS); views only where stores are seen in order
    (x86), since the seqlock of `writing` has no fences."""
    setting = cfg.cluster.shm
    if setting == "off" or not same_host:  # (update.wire_dtype is for what crosses a network:
        return None  # shared memory carries float32 whatever it says)
    if (why := problem()) is not None:
        if setting == "on":
            raise PsrpcError(f"cluster.shm=on but shared memory cannot be used here: {why}; use "
                             "cluster.shm=auto (TCP where shared memory is not available) or off")
        _say(log.warning, "shared memory is off: %s", why)
        return None
    if not in_lockstep(cfg):
        return "slots"
    machine = (machine or platform.machine()).lower()
    if machine not in ORDERED:
        _say(log.info, "shared memory: slots, not views, on %s (reading the master copy in "
             "place relies on x86's store order)", machine)
        return "slots"
    return "views"


_SAID: set[str] = set()


def _say(how, fmt: str, *args) -> None:
    """Log a line once per process (`mode` is asked once per shard)."""
    if (line := fmt % args) not in _SAID:
        _SAID.add(line)
        how("%s", line)


def peer_uid(sock) -> tuple[int, int]:
    """(pid, uid) of the process at the other end of a Unix socket (the kernel's word,
    SO_PEERCRED)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _ = struct.unpack("3i", creds)
    return pid, uid


def close_socket(sock) -> None:
    """Close `sock` so that the peer reads the end now, even if a forked child holds a copy."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


def host_id() -> str:
    """Which machine this process runs on: two ranks with the same id share memory."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"
