"""Rows of sparse embedding tables: what a table is, where each row lives, its initial values.

A table is `num_rows × dim` float32, row-sharded across P parameter servers with TensorFlow's two
partition strategies ("mod": row r on server r % P; "div": contiguous ranges). Nothing here depends
on how rows are partitioned or in which order they are created: initial values come from a
counter-based hash of (table seed, row, column), so a table split over 1 or 3 servers, or created
lazily row by row, starts from the same values.

Hashing is splitmix64 (Steele, Lea and Flood, "Fast splittable pseudorandom number generators",
OOPSLA 2014; the finaliser is Stafford's "Mix13"), written in torch int64 ops. torch's int64
arithmetic wraps modulo 2^64 (two's complement) on CPU and CUDA, which is exactly the unsigned
arithmetic splitmix64 needs; the one difference, `>>` being arithmetic on int64, is undone by a
mask. tests/test_sparse_rows.py checks the result against a pure-Python reference.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from psrpc.errors import one_of

_U64 = 1 << 64


def _signed(c: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    return c - _U64 if c >= 1 << 63 else c


GOLDEN = _signed(0x9E3779B97F4A7C15)  # 2^64 / golden ratio: splitmix64's state increment
MIX1 = _signed(0xBF58476D1CE4E5B9)  # Stafford's Mix13 multipliers
MIX2 = _signed(0x94D049BB133111EB)
# init_rows' counter: row << 16 | column, so a column index must fit in 16 bits and a row in 47
COLUMN_BITS = 16
MAX_DIM = 1 << COLUMN_BITS
MAX_INIT_ROW = 1 << (63 - COLUMN_BITS)
# init_rows works on chunks of this many elements: 64 Ki int64 = 512 KiB per temporary, which
# stays in cache: 1M x 64 takes 0.57 s on one core, against 1.6 s with 4 Mi-element chunks
INIT_CHUNK = 1 << 16


def _mix64_(z: torch.Tensor) -> torch.Tensor:
    """Stafford's Mix13 finaliser, in place on an int64 tensor:
    z ^= z >>> 30; z *= MIX1; z ^= z >>> 27; z *= MIX2; z ^= z >>> 31 (>>> logical)."""
    t = torch.empty_like(z)  # one temporary, reused
    for shift, mult in ((30, MIX1), (27, MIX2), (31, None)):
        torch.bitwise_right_shift(z, shift, out=t)
        t &= (1 << (64 - shift)) - 1  # the mask makes the shift logical
        z ^= t
        if mult is not None:
            z *= mult
    return z


def mix64_int(x: int) -> int:
    """The same finaliser on one Python int (for scalars: seeds and salts); returns int64 bits."""
    z = x % _U64
    for shift, mult in ((30, MIX1 % _U64), (27, MIX2 % _U64), (31, 1)):
        z = ((z ^ (z >> shift)) * mult) % _U64
    return _signed(z)


def hash64(ids: torch.Tensor, salt: int = 0) -> torch.Tensor:
    """A 64-bit hash of each int64 id (the bits as int64): the first output of splitmix64 seeded
    with `id + mix64(salt)`. With salt 0 that is plain splitmix64 seeded with the id. Pure
    function of (id, salt): the same on every process and machine."""
    z = ids.to(torch.int64).clone()
    z += _signed((mix64_int(salt) + GOLDEN) % _U64)
    return _mix64_(z)


def hash_ids(ids: torch.Tensor, size: int, salt: int = 0) -> torch.Tensor:
    """Any int64 ids (negative, huge) -> rows in [0, size): the top 63 bits of `hash64`, mod size
    (the modulo bias is below size / 2^63)."""
    if size <= 0:
        raise ValueError(f"hash_ids: size must be positive, got {size}")
    h = hash64(ids, salt)
    return ((h >> 1) & ((1 << 63) - 1)).remainder_(size)


def table_seed(seed: int, name: str) -> int:
    """The seed of table `name` in a model seeded with `seed`: stable across processes (CRC32 of
    the name, not Python's salted `hash`) and independent of the order tables are listed in."""
    return mix64_int(mix64_int(seed) ^ zlib.crc32(name.encode()))


@dataclass(frozen=True)
class TableSpec:
    """One embedding table. With `hash_size`, features carry raw ids (any int64 except -1, the
    padding value) that are hashed into [0, hash_size) rows; without it, ids are rows.
    `dynamic`: ids are raw (any int64 but -1) and every id gets a row of its own, created on the
    PS the first time the id is trained on (psrpc.sparse.dynamic); `num_rows` is then only the
    expected number of rows, which sets the initial scale."""

    name: str
    num_rows: int
    dim: int
    pooling: str = "sum"  # "sum" or "mean" over a bag's ids
    hash_size: Optional[int] = None
    dynamic: bool = False

    def __post_init__(self):
        if self.num_rows <= 0 or self.dim <= 0:
            raise ValueError(f"table {self.name!r}: num_rows and dim must be positive, got "
                             f"num_rows={self.num_rows}, dim={self.dim}")
        if self.pooling not in ("sum", "mean"):
            raise ValueError(f"table {self.name!r}: pooling={self.pooling!r}, must be 'sum' or "
                             "'mean'")
        if self.dynamic and self.hash_size is not None:
            raise ValueError(f"table {self.name!r}: a dynamic table takes raw ids: hash_size "
                             f"must be None, got {self.hash_size}")
        if self.hash_size is not None and self.hash_size != self.num_rows:
            raise ValueError(f"table {self.name!r}: hash_size={self.hash_size} must equal "
                             f"num_rows={self.num_rows}")

    @property
    def init_scale(self) -> float:
        """Initial values are uniform in [-init_scale, init_scale] with init_scale =
        sqrt(1 / num_rows), as TorchRec's and the DLRM reference's default."""
        return math.sqrt(1.0 / self.num_rows)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Feature ids (no padding) -> table rows: hashed when hash_size is set, else checked to
        lie in [0, num_rows); a dynamic table's ids are its rows."""
        if self.dynamic:
            return ids
        if self.hash_size is not None:
            return hash_ids(ids, self.hash_size)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_rows):
            raise ValueError(f"table {self.name!r}: ids must lie in [0, {self.num_rows}), got "
                             f"[{int(ids.min())}, {int(ids.max())}]")
        return ids


class Partition:
    """Which server holds each row of a `num_rows` table over `num_ps` servers, and at which local
    row, with TensorFlow's `partition_strategy`: "mod" (row r on server r % P, local row r // P)
    or "div" (contiguous ranges; the first num_rows % P servers hold one row more)."""

    STRATEGIES = ("mod", "div")

    def __init__(self, num_rows: int, num_ps: int, strategy: str = "mod"):
        one_of(self.STRATEGIES, strategy, "sparse.partition")
        if num_rows <= 0 or num_ps <= 0:
            raise ValueError(f"Partition: num_rows={num_rows} and num_ps={num_ps} must be "
                             "positive")
        self.num_rows, self.num_ps, self.strategy = num_rows, num_ps, strategy
        q, extras = divmod(num_rows, num_ps)
        self._q, self._extras = q, extras
        sizes = [q + (k < extras) for k in range(num_ps)]
        self._sizes = sizes
        self._starts = [sum(sizes[:k]) for k in range(num_ps)]  # "div" only

    def rows_on(self, k: int) -> int:
        """How many rows server k holds."""
        self._check_server(k)
        if self.strategy == "mod":
            return max(0, -(-(self.num_rows - k) // self.num_ps))
        return self._sizes[k]

    def _check_server(self, k: int) -> None:
        if not 0 <= k < self.num_ps:
            raise ValueError(f"Partition: server {k} out of range [0, {self.num_ps})")

    def owner(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows -> (server, local row), both int64 like `ids`."""
        ids = ids.to(torch.int64)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_rows):
            raise ValueError(f"Partition: rows must lie in [0, {self.num_rows}), got "
                             f"[{int(ids.min())}, {int(ids.max())}]")
        if self.strategy == "mod":
            return ids.remainder(self.num_ps), ids.div(self.num_ps, rounding_mode="floor")
        q, e = self._q, self._extras
        big = q + 1  # the first e servers hold q + 1 rows each, rows [0, e * (q + 1))
        in_big = ids < e * big
        rest = ids - e * big
        qq = max(q, 1)  # q == 0 (fewer rows than servers): every row is in a big server
        server = torch.where(in_big, ids // big, e + rest // qq)
        local = torch.where(in_big, ids % big, rest % qq)
        return server, local

    def split(self, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One (positions, local_rows) pair per server: `ids[positions]` are the rows server k
        holds (positions ascending), at local rows `local_rows`."""
        if self.num_ps == 1:  # every row on the one server, at its own index
            _, local = self.owner(ids)  # (the check)
            return [(torch.arange(ids.numel()), local)]
        server, local = self.owner(ids)
        order = torch.argsort(server, stable=True)
        counts = torch.bincount(server, minlength=self.num_ps).tolist()
        return [(pos, local[pos]) for pos in order.split(counts)]

    def global_rows(self, k: int) -> torch.Tensor:
        """The global rows server k holds, in local order."""
        self._check_server(k)
        if self.strategy == "mod":
            return torch.arange(k, max(k, self.num_rows), self.num_ps, dtype=torch.int64)
        return torch.arange(self._starts[k], self._starts[k] + self._sizes[k], dtype=torch.int64)


class HashPartition:
    """A dynamic table's ids over `num_ps` servers: id i on server (the bits 32..63 of
    i × 2^64/φ) % P, Fibonacci hashing (a hash, not the value: sequential ids spread evenly;
    three array operations, paid on every pull and push). An id is its own "local row": the
    server maps it to storage itself. The same interface as `Partition` where the worker uses
    it."""

    def __init__(self, num_ps: int):
        if num_ps <= 0:
            raise ValueError(f"HashPartition: num_ps={num_ps} must be positive")
        self.num_ps = num_ps

    def owner(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Ids -> (server, id)."""
        ids = ids.to(torch.int64)
        if self.num_ps == 1:
            return torch.zeros_like(ids), ids
        return torch.from_numpy(self.servers(ids.numpy())), ids

    def servers(self, ids: np.ndarray) -> np.ndarray:
        """Each int64 id's server, as a NumPy int64 array."""
        h = (ids.view(np.uint64) * np.uint64(GOLDEN % _U64)) >> np.uint64(32)
        return (h % np.uint64(self.num_ps)).view(np.int64)

    def split(self, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One (positions, ids) pair per server, positions ascending (ids stay in the order
        given: ascending ids stay ascending)."""
        if self.num_ps == 1:
            return [(torch.arange(ids.numel()), ids)]
        server, _ = self.owner(ids)
        order = torch.argsort(server, stable=True)
        counts = torch.bincount(server, minlength=self.num_ps).tolist()
        return [(pos, ids[pos]) for pos in order.split(counts)]


def partition_of(spec: "TableSpec", num_ps: int, strategy: str):
    """The partition a table's rows follow: by hash of the id for a dynamic table, else by
    `sparse.partition`."""
    return HashPartition(num_ps) if spec.dynamic else Partition(spec.num_rows, num_ps, strategy)


_MIX1_NP, _MIX2_NP = np.uint64(MIX1 % _U64), np.uint64(MIX2 % _U64)
_SHIFTS_NP = tuple(np.uint64(k) for k in (30, 27, 31, COLUMN_BITS, 64 - (63 - COLUMN_BITS)))


def _mix64_np_(z: np.ndarray) -> np.ndarray:
    """Stafford's Mix13 on a uint64 array, in place (array arithmetic wraps mod 2^64)."""
    s30, s27, s31 = _SHIFTS_NP[:3]
    z ^= z >> s30
    z *= _MIX1_NP
    z ^= z >> s27
    z *= _MIX2_NP
    z ^= z >> s31
    return z


def seed_offset(seed: int) -> np.uint64:
    """What `hash64` adds to an id salted with `seed`, as a uint64."""
    return np.uint64((mix64_int(seed) + GOLDEN) % _U64)


def init_ids(ids: torch.Tensor, dim: int, table_seed: int, scale: float) -> torch.Tensor:
    """Initial values of a dynamic table's rows, from the raw ids (any int64): `init_rows` of a
    47-bit hash of each id, so a row starts from the same values on any server, whenever it is
    created (and again after an eviction). Computed with NumPy, bit for bit `init_rows`
    (tests/test_dynamic_tables.py checks)."""
    n = ids.numel()
    return init_ids_np(ids.numpy(), dim, np.full(n, seed_offset(table_seed), dtype=np.uint64),
                       np.full(n, scale / (1 << 23), dtype=np.float32))


def init_ids_np(ids: np.ndarray, dim: int, offsets: np.ndarray,
                factors: np.ndarray) -> torch.Tensor:
    """`init_ids` of ids from several tables at once: each id's table as its `seed_offset`
    and its `scale / 2^23` (float32)."""
    if not 0 < dim <= MAX_DIM:
        raise ValueError(f"init_ids: dim={dim} must lie in [1, {MAX_DIM}]")
    key = ids.astype(np.int64, copy=True).view(np.uint64)
    key += offsets
    key = _mix64_np_(key) >> _SHIFTS_NP[4]  # the top 47 bits of hash64(id, table seed)
    z = (key[:, None] << _SHIFTS_NP[3]) + np.arange(dim, dtype=np.uint64)
    z += offsets[:, None]
    _mix64_np_(z)
    top = (z.view(np.int64) >> 40).astype(np.float32)  # the top 24 bits, signed, as init_rows
    top += np.float32(0.5)
    top *= factors[:, None]
    return torch.from_numpy(top)


def init_rows(global_rows: torch.Tensor, dim: int, table_seed: int, scale: float) -> torch.Tensor:
    """Initial values of the given rows, (n, dim) float32, uniform in [-scale, scale]: element
    (row, col) is a function of (table_seed, row, col) only, computed from the top 24 bits of
    `hash64(row << 16 | col, table_seed)` (exact in float32, never exactly ±scale). The same row
    gets the same values in any partition, order or chunk, and a table of dim d is the first d
    columns of a wider one. Works in chunks of INIT_CHUNK elements."""
    if not 0 < dim <= MAX_DIM:
        raise ValueError(f"init_rows: dim={dim} must lie in [1, {MAX_DIM}]")
    rows = global_rows.to(torch.int64).reshape(-1)
    if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= MAX_INIT_ROW):
        raise ValueError(f"init_rows: rows must lie in [0, 2^{63 - COLUMN_BITS})")
    out = torch.empty(rows.numel(), dim, dtype=torch.float32)
    cols = torch.arange(dim, dtype=torch.int64)
    offset = _signed((mix64_int(table_seed) + GOLDEN) % _U64)
    step = max(1, INIT_CHUNK // dim)
    for start in range(0, rows.numel(), step):
        z = (rows[start:start + step] << COLUMN_BITS).unsqueeze(1) + cols  # (chunk, dim) counter
        z += offset
        _mix64_(z)
        z >>= 40  # the top 24 bits (arithmetic shift: in [-2^23, 2^23))
        # (u + 0.5) / 2^23 with u in [-2^23, 2^23): symmetric in (-1, 1), never ±1
        out[start:start + step] = z.to(torch.float32).add_(0.5).mul_(scale / (1 << 23))
    return out


def coalesce(ids: torch.Tensor, grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Duplicate ids summed: (unique ids ascending, (U, dim) sums). On CPU index_add_ adds in
    input order, so the sums are deterministic; on CUDA it uses atomics (order varies)."""
    unique, inverse = torch.unique(ids, sorted=True, return_inverse=True)
    summed = grads.new_zeros(unique.numel(), *grads.shape[1:])
    summed.index_add_(0, inverse, grads)
    return unique, summed


def mean_rows(parts: list[tuple], divisor: int) -> tuple:
    """The mean of several gradients of one table: `parts` = [(unique rows, (U, dim) grads[,
    counts])], in order; returns (unique rows ascending, the sums divided by `divisor`[, the
    summed counts], inverse): every part's rows, duplicates summed in the parts' order. The PS
    averages a sync round's pushes with it, and a worker its micro-batches (train.accumulate),
    so one worker accumulating W micro-batches gives the bits of W workers. `inverse` maps the
    concatenated rows of `parts` to the result's."""
    grads = torch.cat([p[1] for p in parts])
    unique, inverse = torch.unique(torch.cat([p[0] for p in parts]), sorted=True,
                                   return_inverse=True)
    summed = grads.new_zeros(unique.numel(), *grads.shape[1:])
    summed.index_add_(0, inverse, grads)  # (on CPU in input order: see coalesce)
    out = (unique, summed.div_(divisor))
    if len(parts[0]) > 2:  # a dynamic table's: how many times each id was named, summed
        counts = torch.zeros(unique.numel(), dtype=torch.int64)
        out += (counts.index_add_(0, inverse, torch.cat([p[2] for p in parts])),)
    return out + (inverse,)
