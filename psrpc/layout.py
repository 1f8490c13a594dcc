"""Where each parameter lives: the sharding plan, and flat per-shard buffers.

Whole tensors are placed greedily by bytes (the emptiest PS takes the next-largest tensor); a
tensor larger than `max_shard_bytes` is first cut along dim 0 into pieces of at most that size.
Each shard is one flat float32 buffer: its pieces back to back, in placement order. Sharding
never changes the math (every optimizer here is elementwise).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Mapping

import torch


@dataclass(frozen=True)
class Piece:
    """Rows [row_start, row_end) of tensor `name`, stored in shard `shard` at `offset`."""

    name: str
    row_start: int
    row_end: int
    shard: int
    offset: int  # elements into the shard's flat buffer
    numel: int


@dataclass(frozen=True)
class Layout:
    shapes: dict[str, tuple[int, ...]]  # every parameter, in model order
    pieces: tuple[Piece, ...]  # grouped by shard, in offset order within a shard
    shard_numel: tuple[int, ...]

    @property
    def num_shards(self) -> int:
        return len(self.shard_numel)

    def pieces_of(self, shard: int) -> list[Piece]:
        return [p for p in self.pieces if p.shard == shard]

    def pieces_for(self, name: str) -> list[Piece]:
        return [p for p in self.pieces if p.name == name]

    @property
    def split_names(self) -> set[str]:
        """Tensors cut across more than one piece."""
        seen: dict[str, int] = {}
        for p in self.pieces:
            seen[p.name] = seen.get(p.name, 0) + 1
        return {n for n, c in seen.items() if c > 1}

    # -- plan --------------------------------------------------------------------------------
    @classmethod
    def plan(cls, shapes: Mapping[str, tuple[int, ...]], num_shards: int,
             max_shard_bytes: int, element_size: int = 4) -> "Layout":
        shapes = {n: tuple(s) for n, s in shapes.items()}
        chunks = []  # (bytes, order, name, row_start, row_end)
        for order, (name, shape) in enumerate(shapes.items()):
            numel = math.prod(shape)
            rows = shape[0] if shape else 1
            n_pieces = 1
            if numel * element_size > max_shard_bytes and rows > 1:
                n_pieces = min(rows, math.ceil(numel * element_size / max_shard_bytes))
            bounds = [rows * i // n_pieces for i in range(n_pieces + 1)]
            row_numel = numel // rows if rows else 0
            for a, b in zip(bounds, bounds[1:]):
                chunks.append(((b - a) * row_numel * element_size, order, name, a, b))
        # Next-largest first; ties keep model order, so the plan is deterministic.
        chunks.sort(key=lambda c: (-c[0], c[1], c[3]))
        load = [0] * num_shards
        placed: list[list[tuple]] = [[] for _ in range(num_shards)]
        for nbytes, order, name, a, b in chunks:
            k = min(range(num_shards), key=lambda i: (load[i], i))  # the emptiest PS
            load[k] += nbytes
            placed[k].append((name, a, b, nbytes // element_size))
        pieces, numels = [], []
        for k in range(num_shards):
            offset = 0
            for name, a, b, numel in placed[k]:
                pieces.append(Piece(name, a, b, k, offset, numel))
                offset += numel
            numels.append(offset)
        return cls(shapes, tuple(pieces), tuple(numels))

    @classmethod
    def concat(cls, layouts: list["Layout"]) -> "Layout":
        """One layout of all shards of several (per-stage) layouts: shard k of layout s becomes
        shard s·P + k. Data parallel has one stage: concat([l]) == l."""
        shapes, pieces, numels = {}, [], []
        for layout in layouts:
            first = len(numels)
            shapes.update(layout.shapes)
            pieces += [Piece(p.name, p.row_start, p.row_end, first + p.shard, p.offset, p.numel)
                       for p in layout.pieces]
            numels += layout.shard_numel
        return cls(shapes, tuple(pieces), tuple(numels))

    # -- flat buffers <-> tensors --------------------------------------------------------------
    def split(self, tensors: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        """Named tensors -> one flat float32 CPU buffer per shard."""
        flats = [torch.empty(n, dtype=torch.float32) for n in self.shard_numel]
        for p in self.pieces:
            flats[p.shard][p.offset:p.offset + p.numel].copy_(
                self._rows(tensors[p.name], p).reshape(-1))
        return flats

    def join(self, flats: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """One flat buffer per shard -> named tensors (fresh CPU tensors, model order)."""
        out = {n: torch.empty(s, dtype=torch.float32) for n, s in self.shapes.items()}
        for p in self.pieces:
            self._rows(out[p.name], p).reshape(-1).copy_(flats[p.shard][p.offset:p.offset + p.numel])
        return out

    def _rows(self, t: torch.Tensor, p: Piece) -> torch.Tensor:
        return t if t.dim() == 0 else t[p.row_start:p.row_end]

    # -- manifest form -------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"shapes": {n: list(s) for n, s in self.shapes.items()},
                "pieces": [asdict(p) for p in self.pieces],
                "shard_numel": list(self.shard_numel)}

    @classmethod
    def from_dict(cls, d: dict) -> "Layout":
        return cls({n: tuple(s) for n, s in d["shapes"].items()},
                   tuple(Piece(**p) for p in d["pieces"]), tuple(d["shard_numel"]))
