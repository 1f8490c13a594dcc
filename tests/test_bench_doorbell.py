"""benchmarks.doorbell: the message it times comes back whole through the shared buffer, and a
dead echo process ends a measurement with an error instead of a wait."""

from __future__ import annotations

import mmap

import pytest
import torch

from benchmarks import doorbell


def test_a_pickled_message_comes_back_equal():
    msg = doorbell.message(510, 16)
    buf = mmap.mmap(-1, 1 << 20)
    doorbell._write(memoryview(buf)[4096:], msg)
    got = doorbell._read(memoryview(buf)[4096:])
    assert got.keys() == msg.keys()
    for name, (ids, rows) in msg.items():
        assert torch.equal(got[name][0], ids) and torch.equal(got[name][1], rows)


@pytest.mark.timeout(120)
def test_round_trips_through_a_second_process():
    for pickled in (False, True):
        assert 0 < doorbell.doorbell(doorbell.message(510, 16), 5, pickled=pickled) < 1.0


def test_a_missing_doorbell_is_an_error_not_a_hang(tmp_path):
    import os

    fifo = tmp_path / "bell"
    os.mkfifo(fifo)
    fd = os.open(fifo, os.O_RDWR)
    with pytest.raises(TimeoutError, match="no doorbell"):
        doorbell._wait(fd, timeout_s=0.2)
    os.close(fd)
