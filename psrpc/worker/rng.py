"""Randomness is state: what a worker draws while it trains (dropout masks, noise, a user's
`random`) is a function of (train.seed, replica, step) and nothing else.

Before each step's forward pass a worker seeds torch (CPU and every CUDA device), Python's
`random` and NumPy's global generator (when NumPy is loaded) from that triple. So a run resumed
from a checkpoint, a worker started again in a new membership epoch, every shard rolled back to
a checkpoint, or loading with data.num_workers=0 or 2 all draw exactly what the uninterrupted
run drew: the checkpoint's step is the whole of the generators' state, there is none to save or
to lose with a killed process. Loading seeds per sample and puts the generators back (`kept`),
so it never moves the training stream.
"""

from __future__ import annotations

import random
import sys
from contextlib import contextmanager

import torch

_MASK = (1 << 63) - 1


def step_seed(seed: int, replica: int, step: int) -> int:
    """The seed of `replica`'s draws at global batch `step` (splitmix64-style mixing: nearby
    triples give unrelated streams)."""
    z = (seed * 0x9E3779B97F4A7C15 + replica * 0xBF58476D1CE4E5B9 + step * 0x94D049BB133111EB)
    z &= (1 << 64) - 1
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return (z ^ (z >> 31)) & _MASK


def seed_all(seed: int) -> None:
    """Seed every generator a model or a dataset draws from in this process."""
    # torch.manual_seed's generators, without its lazy seeding of accelerators this process
    # never used (it records a stack trace each time: 5 % of a small model's step)
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(seed)
    random.seed(seed)
    numpy = sys.modules.get("numpy")  # only when something loaded it: never import it here
    if numpy is not None:
        numpy.random.seed(seed % (1 << 32))


@contextmanager
def kept():
    """Run the block, then put this process's generators back as they were: torch's (CPU, and
    the CUDA devices once CUDA is in use), Python's and NumPy's."""
    cuda = range(torch.cuda.device_count()) if torch.cuda.is_initialized() else []
    py = random.getstate()
    numpy = sys.modules.get("numpy")
    np_state = numpy.random.get_state() if numpy is not None else None
    try:
        with torch.random.fork_rng(devices=cuda):
            yield
    finally:
        random.setstate(py)
        if np_state is not None:
            numpy.random.set_state(np_state)
