"""Where psrpc's shared memory lives on a host, and which runs there are alive
(psrpc/cluster/shm.py has the segments themselves).

/dev/shm is writable by every local user, so psrpc keeps nothing directly in it. Each user gets
a directory of their own, `/dev/shm/psrpc-<uid>`, mode 0700: no other user can create, rename
or delete anything inside it. It is used only after `lstat` says it is a directory (not a
symlink), owned by this user, with mode 0700; otherwise shared memory is off on this host (TCP),
with the reason in the log, or the run stops with it when `cluster.shm=on`.

Inside it, a run's files are named `psrpc-<run>-...` with `<run>` = `<pid>x<6 hex digits>`:
- segments `psrpc-<run>-s<g>-params` and `psrpc-<run>-s<g>-g<w>` (shm.py);
- lock files `psrpc-<run>-<who>.lock`: every process that keeps the run alive on this host (the
  local launcher for the whole run, each PS, each worker that maps a segment) holds an exclusive
  `flock` on its own for as long as it lives; the kernel drops it when the process dies, even by
  SIGKILL.

A run whose lock files nobody holds has no process left here: `remove_stale` removes its files
(after a whole run was killed at once by a job scheduler or the OOM killer). Even inside the
private directory nothing is taken on trust: only names that match these patterns exactly are
touched, a lock file is opened with O_NONBLOCK | O_NOFOLLOW and checked with fstat (a regular
file of this user) before any flock, and a file that cannot be examined or removed is logged
and skipped, never an error that stops a launch.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import stat
from pathlib import Path
from typing import Optional

from psrpc.errors import PsrpcError

log = logging.getLogger("psrpc")
SHM_ROOT = Path("/dev/shm")  # the host's shared-memory file system
RUN = r"\d+x[0-9a-f]{6}"  # shm.new_run's names
_RUN_RE = re.compile(RUN)
WHO = r"launcher|ps\d+|worker\d+"  # who holds a lock: the local launcher, a PS, a worker
_LOCK_RE = re.compile(rf"psrpc-(?P<run>{RUN})-(?:{WHO})\.lock")
_FILE_RE = re.compile(  # a shard's master copy, a worker's gradient slot, a ring to a backup
    rf"psrpc-(?P<run>{RUN})-(?:s\d+-(?:params|g\d+|ring[0-9a-f]{{8}})|(?:{WHO})\.lock)")
_HELD: dict[str, int] = {}  # lock file name -> the descriptor that holds its lock


def directory() -> Path:
    """This user's directory for shared memory (it may not exist yet: see `problem`)."""
    return SHM_ROOT / f"psrpc-{os.geteuid()}"


def problem() -> Optional[str]:
    """None when this user's directory exists (made here if need be) and is safe to use, else
    why not."""
    if not (SHM_ROOT.is_dir() and os.access(SHM_ROOT, os.W_OK)):
        return f"{SHM_ROOT} is not a writable directory here"
    path = directory()
    try:
        os.mkdir(path, 0o700)
        os.chmod(path, 0o700)  # whatever the umask (nobody else can reach it yet)
    except FileExistsError:
        pass
    except OSError as e:
        return f"{path} cannot be made ({e.strerror})"
    try:
        st = os.lstat(path)
    except OSError as e:
        return f"{path} cannot be examined ({e.strerror})"
    wrong = ("is not a directory" + (" (a symlink)" if stat.S_ISLNK(st.st_mode) else "")
             if not stat.S_ISDIR(st.st_mode) else
             f"belongs to uid {st.st_uid}, not {os.geteuid()}" if st.st_uid != os.geteuid() else
             f"has mode {stat.S_IMODE(st.st_mode):o}, not 700"
             if stat.S_IMODE(st.st_mode) != 0o700 else None)
    if wrong:
        return (f"{path} {wrong}: it is not this user's private directory (another user made "
                "it, or it was changed); remove it, or run with cluster.shm=off")
    return None


def available() -> bool:
    """Whether this host's shared memory can be used (`problem` says why not)."""
    return problem() is None


def _name_ok(run: str, who: str) -> str:
    name = f"psrpc-{run}-{who}.lock"
    if not _LOCK_RE.fullmatch(name):
        raise PsrpcError(f"{name!r} is not a psrpc lock name (run <pid>x<6 hex>, who launcher, ps<k> or worker<i>)")
    return name


def _open_lock(name: str, create: bool) -> int:
    """A descriptor of lock file `name` in this user's directory, checked through it: a regular
    file of this user. Never blocks (a FIFO, say) and never follows a symlink. Raises OSError
    (FileNotFoundError when it is not there) or PsrpcError saying what is wrong."""
    flags = os.O_RDWR | os.O_NONBLOCK | os.O_NOFOLLOW | (os.O_CREAT if create else 0)
    fd = os.open(directory() / name, flags, 0o600)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        os.close(fd)
        what = "not a regular file" if not stat.S_ISREG(st.st_mode) else \
            f"owned by uid {st.st_uid}"
        raise PsrpcError(f"{directory() / name} is {what}: not a lock psrpc made")
    return fd


def hold(run: str, who: str) -> None:
    """Mark `run` alive on this host for as long as this process lives: an exclusive flock on
    psrpc-<run>-<who>.lock, which the kernel releases when the process dies."""
    name = _name_ok(run, who)
    if name in _HELD:
        return
    if (why := problem()) is not None:
        raise PsrpcError(f"cannot mark the run alive: {why}")
    fd = _open_lock(name, create=True)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise PsrpcError(f"{directory() / name} is locked by another process: two ranks named "
                         f"{who} in one run?") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)  # for a reader: who holds it
    _HELD[name] = fd


def held(run: Optional[str] = None) -> list[str]:
    """The lock files this process holds (of `run`, or all)."""
    return [n for n in _HELD if run is None or _LOCK_RE.fullmatch(n)["run"] == run]


def release(run: Optional[str] = None, remove_files: bool = False) -> None:
    """Give up this process's locks (of `run`, or all); with `remove_files` their files too
    (removed first, while still held, so no other process can mistake the run for dead)."""
    for name in held(run):
        if remove_files:
            unlink(name)
        os.close(_HELD.pop(name))


def unlink(name: str) -> bool:
    """Delete file `name` of this user's directory (processes that map it keep their mapping);
    whether it was there. Another error is logged and skipped."""
    try:
        os.unlink(directory() / name)
    except FileNotFoundError:
        return False
    except OSError as e:
        log.warning("could not remove %s (%s); left as it is", directory() / name, e.strerror)
        return False
    return True


def _names() -> list[str]:
    try:
        return os.listdir(directory())
    except OSError:
        return []


def remove(run: str) -> int:
    """Delete every file of `run` (segments and lock files; exact names only) but the locks
    this process holds (it is alive: `release` removes those); how many."""
    if not _RUN_RE.fullmatch(run):
        return 0
    return sum(unlink(n) for n in _names()
               if (m := _FILE_RE.fullmatch(n)) and m["run"] == run and n not in _HELD)


def remove_stale() -> list[str]:
    """Remove the files of runs on this host that no live process holds (every lock file of the
    run unheld: its processes are gone); returns the runs removed. Runs without lock files are
    left alone (they may be starting), and so is a run with a lock file that cannot be checked."""
    if not available():
        return []
    locks: dict[str, list[str]] = {}
    for name in _names():
        if m := _LOCK_RE.fullmatch(name):
            locks.setdefault(m["run"], []).append(name)
    removed = []
    for run, names in locks.items():
        if all(_unheld(n) for n in names):
            remove(run)
            removed.append(run)
    if removed:
        log.info("removed the shared memory of %d run(s) whose processes are gone: %s",
                 len(removed), ", ".join(removed))
    return removed


def _unheld(name: str) -> bool:
    """Nobody holds lock file `name` (tried without waiting, released at once). A file that is
    not a lock of this user's, or cannot be opened, counts as held (logged): never removed."""
    if name in _HELD:
        return False
    try:
        fd = _open_lock(name, create=False)
    except FileNotFoundError:
        return True  # removed meanwhile: its run has left
    except (OSError, PsrpcError) as e:
        log.warning("skipping %s: %s", directory() / name,
                    e.strerror if isinstance(e, OSError) else e)
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    finally:
        os.close(fd)
    return True
