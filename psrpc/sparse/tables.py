"""The local (single-process) form of a set of embedding tables: one `nn.EmbeddingBag` per table,
holding the whole table. The reference the parameter-server tables are checked against, and what
DDP peers use in benchmarks. Initial values are `init_rows` of every row, so they equal what the
PS shards of the same tables start from, however they are partitioned.

A feature is a LongTensor of ids: (B,) single-valued, or (B, L) multi-valued padded with -1.
Padding is left out of the bag (mean pooling divides by the ids present); a bag with no ids
gives zeros. With `hash_size`, ids are raw (any int64 but -1) and hashed to rows after the
padding is removed.
"""

from __future__ import annotations

import torch
from torch import nn

from psrpc.sparse.rows import TableSpec, init_rows, table_seed

PAD = -1


def bag_inputs(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A feature, (B,) or (B, L) padded with -1 -> (flat_ids, offsets) as `nn.EmbeddingBag`
    takes them: the non-padding ids row by row, and where each of the B bags starts."""
    ids = ids.to(torch.int64)
    if ids.dim() == 1:
        ids = ids.unsqueeze(1)
    elif ids.dim() != 2:
        raise ValueError(f"a feature must be (B,) or (B, L) ids, got shape {tuple(ids.shape)}")
    keep = ids != PAD
    if ids.shape[1] and bool(keep.all()):  # no padding: every bag holds L ids
        b, length = ids.shape
        return ids.reshape(-1), torch.arange(0, b * length, length, dtype=torch.int64)
    counts = keep.sum(1)
    offsets = torch.zeros_like(counts)
    torch.cumsum(counts[:-1], 0, out=offsets[1:])
    return ids[keep], offsets


class EmbeddingTables(nn.Module):
    """`forward(features)`: {table name: (B, dim) pooled embeddings}, for features named as the
    tables (other keys, such as "dense", are ignored). Parameters: `bags.<name>.weight`."""

    def __init__(self, specs: list[TableSpec], seed: int = 0, sparse_grad: bool = False):
        super().__init__()
        names = [s.name for s in specs]
        if len(set(names)) != len(names) or any("." in n or not n for n in names):
            raise ValueError(f"table names must be unique, non-empty and without '.': {names}")
        self.specs = list(specs)
        self.bags = nn.ModuleDict()
        for spec in self.specs:
            weight = init_rows(torch.arange(spec.num_rows), spec.dim, table_seed(seed, spec.name),
                               spec.init_scale)  # given as _weight: no random init to overwrite
            self.bags[spec.name] = nn.EmbeddingBag(spec.num_rows, spec.dim, mode=spec.pooling,
                                                   sparse=sparse_grad, _weight=weight)

    def forward(self, features: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        missing = [s.name for s in self.specs if s.name not in features]
        if missing:
            raise KeyError(f"features {missing} missing (got {sorted(features)})")
        out = {}
        for spec in self.specs:
            flat, offsets = bag_inputs(features[spec.name])
            out[spec.name] = self.bags[spec.name](spec.rows(flat), offsets)
        return out
