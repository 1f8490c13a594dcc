"""A dynamic table outside psrpc: `DynamicBag`, the rows a run trained, by raw id, served
without the parameter servers (and the local form of a dynamic table in `EmbeddingTables`).

An id the table holds gives its row; any other id gives what the parameter servers would have
given it, its initial value (`init_ids`: a hash of the table's seed and the id), or zeros with
`unknown="zero"`. Lookups are a binary search over the ids, sorted once when they are loaded.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from psrpc.sparse.rows import init_ids

UNKNOWN = ("init", "zero")


class DynamicBag(nn.Module):
    """`forward(flat_ids, offsets)` as `nn.EmbeddingBag` takes them; `lookup(ids)` per id."""

    def __init__(self, dim: int, seed: int, init_scale: float, pooling: str = "sum",
                 unknown: str = "init"):
        super().__init__()
        if unknown not in UNKNOWN:
            raise ValueError(f"DynamicBag: unknown={unknown!r}, must be one of {list(UNKNOWN)}")
        self.dim, self.seed, self.init_scale = dim, seed, init_scale
        self.pooling, self.unknown = pooling, unknown
        # not in the state_dict: the rows come from a run's table files (load), not model.pt
        self.register_buffer("ids", torch.empty(0, dtype=torch.int64), persistent=False)
        self.register_buffer("weight", torch.empty(0, dim), persistent=False)

    def load(self, ids: torch.Tensor, weight: torch.Tensor) -> "DynamicBag":
        """The rows of these ids (any order; each id once)."""
        if weight.shape != (ids.numel(), self.dim):
            raise ValueError(f"DynamicBag.load: {ids.numel()} ids need a ({ids.numel()}, "
                             f"{self.dim}) weight, got {tuple(weight.shape)}")
        order = torch.argsort(ids)
        self.ids = ids[order].to(self.ids.device)
        self.weight = weight[order].to(self.weight.device, torch.float32)
        return self

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """(n, dim): each id's row, or its initial value (zeros) when the table has none."""
        ids = ids.to(self.ids.device, torch.int64).reshape(-1)
        out = torch.empty(ids.numel(), self.dim, device=self.weight.device)
        found = torch.zeros(ids.numel(), dtype=torch.bool, device=ids.device)
        if self.ids.numel():
            at = torch.searchsorted(self.ids, ids).clamp_(max=self.ids.numel() - 1)
            found = self.ids[at] == ids
            out[found] = self.weight[at[found]]
        missing = ~found
        if bool(missing.any()):
            out[missing] = (init_ids(ids[missing].cpu(), self.dim, self.seed,
                                     self.init_scale).to(out.device)
                            if self.unknown == "init" else 0.0)
        return out

    def forward(self, flat_ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        unique, inverse = torch.unique(flat_ids, return_inverse=True)
        return F.embedding_bag(inverse, self.lookup(unique), offsets, mode=self.pooling)

    def extra_repr(self) -> str:
        return f"{self.ids.numel()} rows, dim={self.dim}, unknown={self.unknown}"
