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

/dev/shm is world-writable, so nothing there is trusted: a segment is created exclusively
(O_EXCL | O_NOFOLLOW, mode 0600: a planted file or symlink is an error, never truncated or
followed), and mapped only after checking that it is a regular file of this user, 0600, of the
expected size, through the descriptor that was checked (no second lookup of the name). The PS
writes a random nonce into each new segment, and the chief asks every worker to read it back
before the plan uses shared memory: a worker that sees another file, or none (a container with
the same host name and boot id but its own /dev/shm), uses TCP instead (or, with
cluster.shm=on, the run stops with the reason).

Each PS holds an exclusive lock (flock) on `psrpc-<run>-ps<k>.lock` for as long as it lives;
the kernel drops it when the process dies, even by SIGKILL. A run whose lock files are all
unheld has no PS left on this host: the next run's PS removes its segments (`remove_stale`),
which is what cleans up after a whole run killed at once (a job scheduler, the OOM killer),
whose resource tracker died with it.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import logging
import os
import secrets
import socket
import stat
import struct
from multiprocessing import resource_tracker
from pathlib import Path
from typing import Optional

import torch

from psrpc.cluster.topology import replicas
from psrpc.errors import PsrpcError

log = logging.getLogger("psrpc")
SHM_DIR = Path("/dev/shm")
SLOT = "slot"  # what a push carries instead of a gradient: "read my slot"
# What a push carries when the worker's gradient was computed across an update of a master copy
# it reads in place (see `WriteSeq`): "discard my gradient of this step" (sync rounds only).
VOID = "void"
SEQ_ELEMS = 16  # after a master copy, 64 bytes: its write sequence (one int64), then padding
NONCE_BYTES = 16
_TRACKED: set[str] = set()  # the names this process registered with the resource tracker


class SegmentProblem(PsrpcError):
    """A segment is not what its PS created (or not there): this rank cannot share memory."""


def new_run() -> str:
    """A name for a run's segments."""
    return f"{os.getpid()}x{secrets.token_hex(3)}"


def available() -> bool:
    """A shared-memory file system to map segments from (Linux)."""
    return SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK)


def segment(run: str, shard: int, what: str) -> str:
    """The file name of a segment: what = "params", or "g<worker>" for a gradient slot."""
    return f"psrpc-{run}-s{shard}-{what}"


def create(name: str, numel: int, nonce: bytes) -> None:
    """A new float32 segment of `numel` elements, this user's only (0600), with `nonce` in its
    first bytes (overwritten once the shard fills it); an error if the name exists at all (a
    file, or a symlink planted to make psrpc truncate another file). Registered with the
    resource tracker, which removes it if every process that could remove it is killed."""
    path = SHM_DIR / name
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
    _track(name)


def _track(name: str) -> None:
    """Registered with multiprocessing's resource tracker, which removes the file if every
    process that could remove it is killed (the launcher's cleanup, or the next run's, does
    otherwise)."""
    try:
        resource_tracker.register("/" + name, "shared_memory")
        _TRACKED.add(name)
    except Exception:
        pass


def _open_checked(name: str, numel: int) -> int:
    """A descriptor of segment `name`, after checking it is what psrpc created: a regular file
    (not a symlink), owned by this user, mode 0600, `numel` float32 elements. Raises
    SegmentProblem saying what is wrong."""
    path = SHM_DIR / name
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
        raise SegmentProblem(f"{SHM_DIR / name} is not the PS's (its nonce differs: another "
                             "/dev/shm with the same host name and boot id?)")


def check_all(segments: list[tuple[str, int, bytes]]) -> Optional[str]:
    """Called by the chief on a worker with (name, elements, its PS's nonce) of each segment the
    worker would map: None when every one checks out here, else why not."""
    try:
        for name, numel, nonce in segments:
            check(name, numel, nonce)
    except SegmentProblem as e:
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


def unlink(name: str, untrack: bool = False) -> bool:
    """Delete one segment (processes that map it keep their mapping); whether it was there.
    It leaves the resource tracker's list if this process put it there, or with `untrack`
    (the launcher: its ranks share its tracker); never otherwise (another run's tracker)."""
    try:
        os.unlink(SHM_DIR / name)
    except FileNotFoundError:
        return False
    if name in _TRACKED or untrack:
        _TRACKED.discard(name)
        try:
            resource_tracker.unregister("/" + name, "shared_memory")
        except Exception:
            pass
    return True


def remove(run: str, untrack: bool = False) -> int:
    """Delete every segment of `run` (and its lock files); returns how many there were."""
    return sum(unlink(os.path.basename(p), untrack)
               for p in glob.glob(str(SHM_DIR / f"psrpc-{run}-*")))


_HELD: dict[str, int] = {}  # lock file name -> the descriptor that holds its lock


def hold(run: str, who: str) -> None:
    """Mark `run` alive on this host for as long as this process lives: an exclusive flock on
    psrpc-<run>-<who>.lock, which the kernel releases when the process dies."""
    name = f"psrpc-{run}-{who}.lock"
    if name in _HELD:
        return
    fd = os.open(SHM_DIR / name, os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise PsrpcError(f"{SHM_DIR / name} is locked by another process: two ranks named "
                         f"{who} in one run?") from None
    os.pwrite(fd, str(os.getpid()).encode(), 0)  # for a reader: who holds it
    _HELD[name] = fd
    _track(name)  # removed with the segments if the whole run is killed


def held() -> list[str]:
    """The lock files this process holds."""
    return list(_HELD)


def release() -> None:
    """This process's locks (it is leaving, its segments are removed)."""
    for fd in _HELD.values():
        os.close(fd)
    _HELD.clear()


def remove_stale() -> list[str]:
    """Remove the segments of runs on this host that no live PS holds (every lock file of the
    run unheld: its processes are gone); returns the runs removed. Runs without lock files are
    left alone (they may be starting)."""
    locks: dict[str, list[Path]] = {}
    for path in SHM_DIR.glob("psrpc-*.lock"):
        run = path.name[len("psrpc-"):].rsplit("-", 1)[0]
        locks.setdefault(run, []).append(path)
    removed = []
    for run, paths in locks.items():
        if all(_unheld(p) for p in paths):
            remove(run)
            removed.append(run)
    if removed:
        log.info("removed the shared memory of %d run(s) whose processes are gone: %s",
                 len(removed), ", ".join(removed))
    return removed


def _unheld(path: Path) -> bool:
    """Nobody holds `path`'s lock (tried without waiting, released at once)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    finally:
        os.close(fd)
    return True


def mode(cfg, same_host: bool) -> Optional[str]:
    """How a worker and a PS on `same_host` exchange a dense shard: "views" (slots, and the
    worker's parameters are views of the master copy: sync with every worker in each round),
    "slots" (gradients through slots, parameters in the reply), or None (TCP)."""
    setting = cfg.cluster.shm
    if setting == "off" or not same_host or cfg.update.wire_dtype != "float32":
        return None
    if not available():
        if setting == "on":
            raise PsrpcError(f"cluster.shm=on but {SHM_DIR} is not writable here: use "
                             "cluster.shm=auto (TCP where shared memory is not available) or off")
        return None
    everyone = (cfg.update.name == "sync" and cfg.update.replicas_to_aggregate in
                (None, replicas(cfg)))
    return "views" if everyone else "slots"


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
