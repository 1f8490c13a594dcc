"""The fault campaign's quick subset: a few seeded schedules of benchmarks/chaos.py (the whole
campaign, 100 schedules, is `python -m benchmarks.chaos`), each checked for every invariant:
it ends within its bound, finishes when it can (or names the cause), leaves no process and no
/dev/shm segment, and its newest committed checkpoint loads."""

import tempfile
from pathlib import Path

import pytest

from benchmarks import chaos

pytestmark = pytest.mark.timeout(400)


@pytest.mark.parametrize("fault", ["kill_two", "kill_rejoining", "kill_in_eval",
                                    "truncated_checkpoint", "kill_launcher"])
def test_a_seeded_schedule_keeps_every_invariant(fault):
    index = list(chaos.FAULTS).index(fault)  # the first len(FAULTS) schedules: one of each
    s = chaos.schedule(seed=0, index=index)
    assert s["fault"] == fault
    with tempfile.TemporaryDirectory(prefix="psrpc-chaos-") as tmp:
        row = chaos.run_schedule(s, Path(tmp), steps=120, bound_s=150)
    assert row["ok"], f"schedule {index} ({row['did']}): {row['problems']}"
    if row["could_finish"]:
        assert row["outcome"] == "finished" and row["steps"] == 120
