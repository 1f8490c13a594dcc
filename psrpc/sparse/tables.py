"""Embedding tables as a model uses them: `EmbeddingTables(specs)`, one module for all of a
model's tables (TorchRec's EmbeddingBagCollection), `forward(features) -> {name: (B, dim)}`.

Two forms, the same module:
- local (built anywhere else): one `nn.EmbeddingBag` per table, holding the whole table. The
  reference the parameter-server tables are checked against, and what DDP peers use in
  benchmarks. Initial values are `init_rows` of every row, so they equal what the PS shards of the
  same tables start from, however they are partitioned.
- remote (built by psrpc inside `remote_tables()`, on every worker): holds no table at all. A
  forward takes the unique rows of the batch for every table, pulls them from the parameter
  servers that own them (all in flight at once, through the `RowClient` psrpc binds), pools them
  with `F.embedding_bag` on a leaf tensor of just those rows, and keeps the leaves: after
  backward, `take_gradients()` gives each table's (unique rows, row gradients), coalesced by
  construction, for the push.

A feature is a LongTensor of ids: (B,) single-valued, or (B, L) multi-valued padded with -1.
Padding is left out of the bag (mean pooling divides by the ids present); a bag with no ids
gives zeros. With `hash_size`, ids are raw (any int64 but -1) and hashed to rows after the
padding is removed.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import replace
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from psrpc.sparse.lookup import DynamicBag
from psrpc.sparse.rows import TableSpec, init_rows, table_seed

PAD = -1
PREPARED = 2  # features whose lookups rows_for keeps (the next two steps' batches)
_MODE = threading.local()


@contextmanager
def remote_tables():
    """EmbeddingTables built inside hold no rows: their lookups go to the parameter servers."""
    before = getattr(_MODE, "remote", False)
    _MODE.remote = True
    try:
        yield
    finally:
        _MODE.remote = before


@contextmanager
def table_options(dynamic: bool = False, hash_size: Optional[int] = None):
    """EmbeddingTables built inside take these for every table: `dynamic` (raw ids, a row per
    id), or `hash_size` (raw ids hashed into that many rows). psrpc's sparse.dynamic and
    sparse.hash_size."""
    before = getattr(_MODE, "options", None)
    _MODE.options = (dynamic, hash_size)
    try:
        yield
    finally:
        _MODE.options = before


def with_options(spec: TableSpec) -> TableSpec:
    dynamic, hash_size = getattr(_MODE, "options", None) or (False, None)
    if hash_size:
        return replace(spec, num_rows=hash_size, hash_size=hash_size, dynamic=False)
    if dynamic and not spec.dynamic:
        return replace(spec, hash_size=None, dynamic=True)
    return spec


def find_tables(model: nn.Module) -> list["EmbeddingTables"]:
    return [m for m in model.modules() if isinstance(m, EmbeddingTables)]


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
        specs = [with_options(s) for s in specs]
        names = [s.name for s in specs]
        if len(set(names)) != len(names) or any("." in n or not n for n in names):
            raise ValueError(f"table names must be unique, non-empty and without '.': {names}")
        self.specs = list(specs)
        self.bags = nn.ModuleDict()
        self.remote = getattr(_MODE, "remote", False)
        self.client = None  # remote: the RowClient psrpc binds
        self.fed = None  # remote: the features of the last forward
        self._leaves: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        self._prepared: list[tuple] = []  # remote: (features, stamp, lookups) of rows_for
        if self.remote:
            return
        for spec in self.specs:
            if spec.dynamic:  # the rows a run trained are loaded into it (load_model)
                self.bags[spec.name] = DynamicBag(spec.dim, table_seed(seed, spec.name),
                                                  spec.init_scale, spec.pooling)
                continue
            weight = init_rows(torch.arange(spec.num_rows), spec.dim, table_seed(seed, spec.name),
                               spec.init_scale)  # given as _weight: no random init to overwrite
            self.bags[spec.name] = nn.EmbeddingBag(spec.num_rows, spec.dim, mode=spec.pooling,
                                                   sparse=sparse_grad, _weight=weight)

    def forward(self, features: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        missing = [s.name for s in self.specs if s.name not in features]
        if missing:
            raise KeyError(f"features {missing} missing (got {sorted(features)})")
        if self.remote:
            return self._remote_forward(features)
        out = {}
        for spec in self.specs:
            flat, offsets = bag_inputs(features[spec.name])
            out[spec.name] = self.bags[spec.name](spec.rows(flat), offsets)
        return out

    # -- remote form -----------------------------------------------------------------------------
    def bind(self, client) -> None:
        """psrpc's RowClient: `pull({table: unique global rows}) -> {table: (U, dim)}`."""
        self.client = client

    def _remote_forward(self, features: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.client is None:
            raise RuntimeError("EmbeddingTables built by psrpc for the parameter servers, used "
                               "without a RowClient bound")
        self.fed = features  # what this forward was given (the worker compares it with its batch)
        bags = self._lookups(features)
        values = self.client.pull({n: b[0] for n, b in bags.items()})  # all tables at once
        track = torch.is_grad_enabled()
        self._leaves = []
        out = {}
        for spec in self.specs:
            rows, inverse, offsets, counts = bags[spec.name]
            device = features[spec.name].device
            weight = values[spec.name].to(device).requires_grad_(track)
            if track:
                self._leaves.append((spec.name, rows, weight, counts))
            out[spec.name] = F.embedding_bag(inverse.to(device), weight, offsets.to(device),
                                             mode=spec.pooling)
        return out

    def _lookups(self, features: dict[str, torch.Tensor], keep: bool = False) -> dict:
        """{table: (unique rows, inverse, offsets, [counts])} of `features`: worked out once
        per features object while its tensors are unchanged (`rows_for` keeps them for the
        forward that follows)."""
        stamp = [(features[s.name], features[s.name]._version) for s in self.specs]
        for k, (fed, seen, bags) in enumerate(self._prepared):
            if fed is features and all(a is b and v == w for (a, v), (b, w) in zip(seen, stamp)):
                return bags if keep else self._prepared.pop(k)[2]
        bags = {}
        for spec in self.specs:
            flat, offsets = bag_inputs(features[spec.name])
            # a dynamic table is told how many times the batch named each id (admission counts)
            rows, inverse, *counts = torch.unique(spec.rows(flat).cpu(), sorted=True,
                                                  return_inverse=True,
                                                  return_counts=spec.dynamic)
            bags[spec.name] = (rows, inverse, offsets, counts)
        if keep:
            self._prepared = (self._prepared + [(features, stamp, bags)])[-PREPARED:]
        return bags

    def rows_for(self, features: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """{table: the unique rows a forward of `features` looks up}, without looking them up;
        what it worked out is kept for that forward (the last PREPARED features so asked)."""
        return {name: b[0] for name, b in self._lookups(features, keep=True).items()}

    def take_gradients(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """After backward: {table: (unique global rows, their gradients on CPU)} of the last
        forward (rows no output used get zero gradients); a dynamic table's also carries how
        many times the batch named each id: (ids, gradients, counts)."""
        out = {}
        for name, rows, weight, counts in self._leaves:
            grad = weight.grad if weight.grad is not None else torch.zeros_like(weight)
            out[name] = (rows, grad.detach().to("cpu", torch.float32), *counts)
        self._leaves = []
        return out

    def __deepcopy__(self, memo):
        """The remote form shares its client (RRefs are not copied); the local form copies."""
        if not self.remote:
            clone = EmbeddingTables.__new__(EmbeddingTables)
            memo[id(self)] = clone
            nn.Module.__init__(clone)
            clone.specs, clone.remote, clone.client, clone._leaves = self.specs, False, None, []
            clone.fed, clone._prepared = None, []
            clone.bags = __import__("copy").deepcopy(self.bags, memo)
            return clone
        with remote_tables():
            clone = EmbeddingTables(self.specs)
        clone.client = self.client
        memo[id(self)] = clone
        return clone


class DryRows:
    """Zeros for any row: for the check before start, which runs a batch through the model
    with no server to ask."""

    def __init__(self, specs: list[TableSpec]):
        self.specs = {s.name: s for s in specs}

    def pull(self, rows: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {n: torch.zeros(r.numel(), self.specs[n].dim) for n, r in rows.items()}
