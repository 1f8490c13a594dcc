"""The one order in which psrpc sums the dense gradients of a sync round: a binary tree over the
workers' indices.

Float addition is not associative, so "the sum of W gradients" is only one value once its order
is fixed. psrpc fixes it as the perfect binary tree over the indices 0, 1, 2, ... with the
leaves nobody gave left out: ((g0 + g1) + (g2 + g3)) + ((g4 + g5) + g6) for seven. Every path
that sums gradients sums them this way: a PS closing a round, the all-reduce of workers on one
host, a worker accumulating micro-batches (micro-batch m as leaf m), a pipeline stage summing
its micro-batches. So W workers of batch B give the bits of one worker accumulating W
micro-batches of B, whichever of these paths carried the sums.

A tree (unlike a left-to-right sum) can be cut into parts that are summed in different places
and still give the same bits: the leaves of an aligned block [j·2^s, (j+1)·2^s) form a subtree,
so the workers of one host whose indices fill such a block can add their gradients on the host
and push one sum (update.host_push); the PS puts that sum in the block's place.

With two or three leaves the tree is the left-to-right sum: (g0 + g1) + g2.
"""

from __future__ import annotations

from typing import Callable

import torch

Item = tuple[int, int, torch.Tensor]  # (first index, level s: covers 2^s indices, tensor)


def tree_sum(items: list[Item], out: torch.Tensor,
             scratch: Callable[[int], torch.Tensor]) -> torch.Tensor:
    """The tree sum of `items` (sorted by first index; each an aligned block's sum: its first
    index a multiple of 2^level): an item's own tensor when there is one, else `out`, written
    in float32. `scratch(level)` gives a float32 buffer shaped like `out` for each level, never
    `out` itself; an item's tensor may be `out` only as the first item (its sum is then built
    in place). Items may be in a lower precision: they are added in float32."""
    if len(items) == 1:
        return items[0][2]
    lo, hi = items[0][0], items[-1][0] + (1 << items[-1][1]) - 1
    level = (lo ^ hi).bit_length()  # the smallest aligned block holding them all: 2^level
    mid = (hi >> (level - 1)) << (level - 1)  # its right half starts here
    left = [i for i in items if i[0] < mid]
    right = [i for i in items if i[0] >= mid]
    a = tree_sum(left, out, scratch)
    b = tree_sum(right, scratch(level - 1), scratch)
    if a is out:
        return out.add_(b)
    if a.dtype == torch.float32 and b.dtype == torch.float32:
        return torch.add(a, b, out=out)
    return out.copy_(a).add_(b)  # (bf16/fp16 items: summed in float32)


class Scratch:
    """Buffers for `tree_sum`, one per level, kept between calls (allocated on first use)."""

    def __init__(self):
        self._bufs: dict[tuple, torch.Tensor] = {}

    def like(self, out: torch.Tensor) -> Callable[[int], torch.Tensor]:
        def get(level: int) -> torch.Tensor:
            key = (level, out.numel(), out.device)
            buf = self._bufs.get(key)
            if buf is None:
                buf = self._bufs[key] = torch.empty(out.shape, dtype=torch.float32,
                                                    device=out.device)
            return buf
        return get


def leaves(tensors: list[torch.Tensor]) -> list[Item]:
    """Tensors 0, 1, 2, ... as the tree's leaves."""
    return [(i, 0, t) for i, t in enumerate(tensors)]


class TreeAccumulator:
    """Adds tensors given one at a time (leaf 0, 1, 2, ...) in the tree's order, keeping at most
    one partial sum per level (a binary counter): what accumulating micro-batches needs. `add`
    copies what it is given (the caller may overwrite it next); `total` is the tree sum."""

    def __init__(self):
        self._stack: list[tuple[int, list[torch.Tensor]]] = []  # (level, tensors), levels falling
        self._spare: list[list[torch.Tensor]] = []

    def add(self, tensors: list[torch.Tensor]) -> None:
        mine = self._spare.pop() if self._spare else [torch.empty_like(t) for t in tensors]
        for m, t in zip(mine, tensors):
            m.copy_(t)
        level = 0
        while self._stack and self._stack[-1][0] == level:  # two sums of 2^level: one of 2^(l+1)
            _, left = self._stack.pop()
            for a, b in zip(left, mine):
                a.add_(b)
            self._spare.append(mine)
            mine, level = left, level + 1
        self._stack.append((level, mine))

    def total(self, into: list[torch.Tensor]) -> None:
        """Write the tree sum of everything added into `into`, and start again."""
        _, right = self._stack.pop()
        while self._stack:  # the rest, from the smallest block up: left + (what is right of it)
            _, left = self._stack.pop()
            for a, b in zip(left, right):
                a.add_(b)
            self._spare.append(right)
            right = left
        for dst, src in zip(into, right):
            dst.copy_(src)
        self._spare.append(right)
