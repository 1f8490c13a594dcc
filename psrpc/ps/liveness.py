"""What the update rules share: who is alive, and a watchdog thread that gives every wait a
timeout."""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

log = logging.getLogger(__name__)


class LiveSet:
    """Workers the update rule still waits for. A worker that misses a deadline is marked lost
    (rounds and staleness bounds stop waiting for it); it is back as soon as it pushes again."""

    def __init__(self, num_workers: int):
        self.num_workers = num_workers
        self.lost: set[int] = set()

    @property
    def alive(self) -> set[int]:
        return set(range(self.num_workers)) - self.lost

    def seen(self, worker: int) -> None:
        if worker in self.lost:
            log.warning("worker%d is back after being counted lost", worker)
            self.lost.discard(worker)

    def lose(self, workers) -> None:
        self.lost.update(workers)


PAUSE_S = 1.0  # a watchdog that did not run for longer than this (plus its period): this
# process was not running (stopped, starved), and no one's time ran out meanwhile
_clock = {"seen": time.monotonic(), "paused": 0.0}
_clock_lock = threading.Lock()


def running_time() -> float:
    """A monotonic clock that stands still while this process does not run (SIGSTOP, a host
    that swaps): the update rules' timeouts read it, so a PS that was hung itself does not
    count the workers it waited for as lost when it runs again (slow is not dead)."""
    with _clock_lock:
        return time.monotonic() - _clock["paused"]


def _tick(period_s: float) -> None:
    """A watchdog ran: a gap since any ran last, beyond its period, is time not run."""
    now = time.monotonic()
    with _clock_lock:
        gap = now - _clock["seen"] - period_s
        if gap > PAUSE_S:
            _clock["paused"] += gap
        _clock["seen"] = now


class Watchdog:
    """Calls `check()` every `period_s` on a daemon thread until closed."""

    def __init__(self, check: Callable[[], None], period_s: float, name: str):
        self._check, self._period = check, period_s
        with _clock_lock:  # (no time before the first watchdog counts as paused)
            _clock["seen"] = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._period):
            _tick(self._period)
            try:
                self._check()
            except Exception:  # a watchdog must never die silently
                log.exception("watchdog check failed")

    def close(self) -> None:
        self._stop.set()
