"""DLRM (Naumov et al., "Deep Learning Recommendation Model for Personalization and
Recommendation Systems", 2019): dense features through a bottom MLP, categorical features through
embedding tables, pairwise dot products between all of those vectors, and a top MLP that gives
one click logit per sample. Train it with `torch.nn.BCEWithLogitsLoss` (float targets).

The tables are one attribute, `tables` (an `EmbeddingTables`: `forward(x) -> {name: (B, dim)}`),
so that the parameter-server version of the tables can take its place.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

from psrpc.sparse.rows import TableSpec
from psrpc.sparse.tables import EmbeddingTables

TABLE_KEYS = {"name", "num_rows", "hash_size", "pooling"}


def _mlp(width_in: int, widths: Sequence[int], relu_last: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, width in enumerate(widths):
        layers.append(nn.Linear(width_in, width))
        if relu_last or i < len(widths) - 1:
            layers.append(nn.ReLU())
        width_in = width
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    """forward(x) with x = {"dense": (B, D) float, "<table name>": ids (B,) or (B, L) padded with
    -1, ...} -> logits (B,). With D = 0 there is no bottom MLP and no "dense" input: the
    interaction is between the embeddings only."""

    def __init__(self, num_dense: int, specs: list[TableSpec], bottom: Sequence[int],
                 top: Sequence[int], seed: int = 0, tables: Optional[nn.Module] = None):
        """`tables`: a module that replaces the local `EmbeddingTables(specs, seed)` (the
        parameter-server tables); the MLPs are the same either way, seeded by `seed` alone."""
        super().__init__()
        dim = specs[0].dim
        self.num_dense = num_dense
        with torch.random.fork_rng(devices=[]):  # seeded layers, the caller's RNG untouched
            torch.manual_seed(seed)
            # the bottom MLP ends in ReLU, as in the DLRM reference (only the top's last layer is
            # linear here: it gives a logit)
            self.bottom = _mlp(num_dense, bottom, relu_last=True) if num_dense else None
            vectors = len(specs) + (1 if num_dense else 0)
            pairs = vectors * (vectors - 1) // 2
            self.top = _mlp((dim if num_dense else 0) + pairs, [*top, 1], relu_last=False)
        self.specs = list(specs)
        self.tables = tables if tables is not None else EmbeddingTables(specs, seed=seed)
        i, j = torch.triu_indices(vectors, vectors, offset=1)  # upper triangle, no diagonal
        self.register_buffer("pair_i", i, persistent=False)
        self.register_buffer("pair_j", j, persistent=False)

    def forward(self, x: dict[str, torch.Tensor]) -> torch.Tensor:
        embedded = self.tables(x)
        vectors = [embedded[spec.name] for spec in self.specs]  # each (B, dim)
        if self.bottom is not None:
            dense = self.bottom(x["dense"])
            vectors.insert(0, dense)
        stacked = torch.stack(vectors, 1)  # (B, F, dim)
        dots = torch.bmm(stacked, stacked.transpose(1, 2))[:, self.pair_i, self.pair_j]
        top_in = torch.cat([dense, dots], 1) if self.bottom is not None else dots
        return self.top(top_in).squeeze(1)


def make_dlrm(num_dense: int, tables: list[dict], bottom: Sequence[int] = (64, 16),
              top: Sequence[int] = (64, 32), dim: int = 16, seed: int = 0) -> DLRM:
    """A DLRM for the tables a dataset describes (dicts with name, num_rows, and optionally
    hash_size and pooling); every table gets `dim` columns. The bottom MLP's last width must be
    `dim`: its output is dotted with the embeddings."""
    if not tables:
        raise ValueError("make_dlrm: needs at least one table")
    for t in tables:
        unknown = set(t) - TABLE_KEYS
        if unknown or "name" not in t or "num_rows" not in t:
            raise ValueError(f"make_dlrm: table {t}: keys must be name, num_rows and optionally "
                             f"hash_size, pooling (unknown: {sorted(unknown)})")
    if num_dense < 0:
        raise ValueError(f"make_dlrm: num_dense={num_dense} must be >= 0")
    if num_dense:
        last = bottom[-1] if len(bottom) else num_dense
        if last != dim:
            raise ValueError(f"make_dlrm: the bottom MLP's last width ({last}, bottom="
                             f"{list(bottom)}) must equal the embedding dim ({dim}): its "
                             "output is dotted with the embeddings")
    elif len(tables) < 2:
        raise ValueError("make_dlrm: with num_dense=0 there must be at least two tables (the "
                         "interaction is between pairs of vectors)")
    specs = [TableSpec(t["name"], t["num_rows"], dim, pooling=t.get("pooling", "sum"),
                       hash_size=t.get("hash_size")) for t in tables]
    return DLRM(num_dense, specs, list(bottom), list(top), seed=seed)
