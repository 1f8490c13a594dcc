"""When and what one shard saves: step-consistent checkpoints without pausing anyone.

A shard snapshots itself under its lock right after the update that brings it to a checkpoint
step (every `checkpoint.every_steps`, or a step the chief asked for), so every shard saves exactly
the same global step; the file is written by a background thread (`checkpoint.save_shard`).
The chief waits on `request(step)` for each shard's file info and writes the manifest.
"""

from __future__ import annotations

import logging
import shutil
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional

import torch

from psrpc import checkpoint
from psrpc.cluster import comm
from psrpc.errors import first_line

log = logging.getLogger(__name__)


class ShardSnapshots:
    """The checkpoint schedule of one shard. Every method runs under the shard's lock."""

    def __init__(self, name: str, root: Optional[str], every: int,
                 state: Callable[[int], dict]):
        self.name, self.root, self.every = name, root, every
        self._state = state  # step -> the shard's state dict, a snapshot (copies)
        self._asked: set[int] = set()  # steps the chief asked to have saved
        self._saves: dict[int, torch.futures.Future] = {}  # step -> file info (None: missed)
        self._started: set[int] = set()  # steps whose snapshot was taken
        self._writer: Optional[ThreadPoolExecutor] = None

    def request(self, step: int, version: int, max_steps: int) -> torch.futures.Future:
        """Future of the file info once step `step` is saved (None if it never will be)."""
        if not self.root:
            return comm.completed(None)
        if step == version:
            self._start(step)
        elif version < step <= max_steps:
            self._asked.add(step)
        elif step not in self._saves:  # already past it unsaved, or beyond the last step
            return comm.completed(None)
        return self._saves.setdefault(step, torch.futures.Future())

    def after_update(self, version: int) -> None:
        """The shard has just reached `version`: snapshot it if it is a checkpoint step."""
        if self.root and (version in self._asked or (self.every and version % self.every == 0)):
            self._start(version)

    def unreachable(self, max_steps: int) -> None:
        """Steps past the last one will never be saved: answer whoever waits for them."""
        for step in [t for t in self._asked if t > max_steps]:
            self._asked.discard(step)
            fut = self._saves.get(step)
            if fut is not None and not fut.done():
                fut.set_result(None)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.shutdown(wait=True)

    def _start(self, step: int) -> None:
        if step in self._started:
            return
        self._started.add(step)
        self._asked.discard(step)
        fut = self._saves.setdefault(step, torch.futures.Future())
        state = self._state(step)
        if self._writer is None:
            self._writer = ThreadPoolExecutor(1, thread_name_prefix=f"{self.name}-ckpt")
        self._writer.submit(self._write, state, fut)

    def _write(self, state: dict, fut: torch.futures.Future) -> None:
        try:
            info = checkpoint.save_shard(self.root, state)
        except checkpoint.StepCommitted as e:
            log.warning("%s: step %d not saved: %s", self.name, state["version"], e)
            info = None
        except Exception as e:  # a failed save must not stop training; the chief skips it
            why = _why(e, self.root)
            log.error("%s: could not save step %d: %s", self.name, state["version"], why)
            info = {"error": f"{self.name}: {why}"}
        if not fut.done():
            fut.set_result(info)


def _why(e: Exception, root) -> str:
    """A failed write in words: torch reports a full disk as a mismatch of positions in its zip
    writer ("unexpected pos"), which names neither the disk nor the folder."""
    if isinstance(e, OSError) and e.strerror:
        return f"{e.strerror} ({e.filename or root})"
    try:
        free = shutil.disk_usage(root).free
    except OSError:
        free = None
    if "unexpected pos" in str(e) and free is not None:
        return f"the file could not be written whole: {free} bytes free in {root}"
    return first_line(e)
