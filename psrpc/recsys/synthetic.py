"""Synthetic click logs for scale: Zipf-distributed ids over any cardinalities (tens of millions
of rows), computed per sample from (seed, split, index), so a dataset of any length costs no
memory and is the same on every process; labels from a hidden logistic model over per-id weights
that are themselves hashes of the ids, so the data is learnable and nothing is materialised.
Uniform ids (TorchRec's RandomRecDataset) would hide the skew of real traffic.

With `raw_ids`, ids are raw 40-bit ids of a catalogue that can drift: new items take the head of
the popularity ranking as training goes on and cool down, as in a real catalogue.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch.utils.data import Dataset

from psrpc.sparse.rows import hash64, mix64_int

RAW_ID_BITS = 40  # raw ids lie in [0, 2^40): never -1, the padding value


def _uniform(keys: torch.Tensor, salt: int) -> torch.Tensor:
    """Counter-based uniforms in (0, 1), float64, from the top 53 bits of hash64(key, salt)."""
    h = (hash64(keys, salt) >> 11) & ((1 << 53) - 1)
    return (h.double() + 0.5) * 2.0 ** -53


def _coprime_multiplier(n: int, salt: int) -> int:
    """A pseudo-random a in [1, n) with gcd(a, n) = 1: rank -> (a * rank + b) mod n is then a
    bijection of [0, n), the fixed shuffle of ranks into ids (no table)."""
    if n <= 2:
        return 1
    a = mix64_int(salt) % (n - 1) + 1
    while math.gcd(a, n) != 1:
        a = a % (n - 1) + 1
    return a


class ClickLogs(Dataset):
    """Synthetic click logs, each sample computed from (seed, split, index) alone: no memory,
    any length, the same on every process.

    Categorical feature k: a Zipf rank r in [0, n_k) by the inverse CDF of a continuous power law
    with exponent `zipf_alpha` on [1, n_k + 1) (floored), then id = (a_k r + b_k) mod n_k so that
    popular ids are spread over the table. Dense features: standard normal. Label: Bernoulli of
    sigmoid(bias + sum_k w_k(id_k) + dense . w_dense), where w_k(id) is uniform, a hash of
    (seed, k, id) (no weight table either), and every one of the K + D terms has variance
    signal^2 / (K + D): the logit's standard deviation is about `signal`.

    `raw_ids`: the rank r in [0, distinct_ids) (the same for every feature; `cardinalities` then
    only gives the number of features) names the catalogue item c = floor(drift * t) - r, t the
    sample's time (its index, or `now` for every sample: the test split's end of training), and
    the id is hash64(c) of a (seed, k) salt, masked to 40 bits. With drift > 0 the head of the
    ranking moves to new items, each item cooling down as newer ones arrive; with drift = 0 the
    catalogue is fixed. The catalogue does not depend on the split.
    """

    def __init__(self, size: int, cardinalities: list[int], num_dense: int, zipf_alpha: float,
                 seed: int, split: int, signal: float, bias: float, raw_ids: bool = False,
                 distinct_ids: int = 100_000, drift: float = 0.0, now: Optional[int] = None):
        self.size, self.cards, self.num_dense = size, list(cardinalities), num_dense
        self.alpha, self.seed, self.bias = zipf_alpha, seed, bias
        self.raw_ids, self.drift, self.now = bool(raw_ids), float(drift), now
        self.ranks = [distinct_ids] * len(self.cards) if self.raw_ids else self.cards
        self.fields = len(self.cards) + num_dense + 1  # uniforms per sample
        self.salt = mix64_int(seed * 1_000_003 + split)  # train and test are different streams
        terms = len(self.cards) + num_dense
        self.term_std = signal / math.sqrt(max(terms, 1))
        self.shuffles = [(_coprime_multiplier(n, mix64_int(seed) + 2 * k),
                          mix64_int(mix64_int(seed) + 2 * k + 1) % n)
                         for k, n in enumerate(self.cards)] if not self.raw_ids else []
        g = torch.Generator().manual_seed(seed)
        self.dense_weights = torch.randn(num_dense, generator=g, dtype=torch.float64)
        self.dense_weights *= self.term_std / self.dense_weights.abs().clamp_min(1e-12)  # ±std

    def __len__(self) -> int:
        return self.size

    def _zipf_rank(self, u: torch.Tensor, n: int) -> torch.Tensor:
        if abs(self.alpha - 1.0) < 1e-9:
            x = torch.exp(u * math.log(n + 1.0))
        else:
            e = 1.0 - self.alpha
            x = (1.0 + u * ((n + 1.0) ** e - 1.0)) ** (1.0 / e)
        return (x.floor().long() - 1).clamp_(0, n - 1)

    def _id_weight(self, k: int, ids: torch.Tensor) -> torch.Tensor:
        u = _uniform(ids, mix64_int(self.seed) ^ (0x5EED + k))
        return (2 * u - 1) * (math.sqrt(3) * self.term_std)  # uniform with std term_std

    def _raw_ids(self, k: int, ranks: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Ranks at the samples' times -> raw ids of the catalogue items they name."""
        t = idx.double() if self.now is None else torch.full_like(idx, self.now).double()
        items = (self.drift * t).floor().long() - ranks
        salt = mix64_int(mix64_int(self.seed) ^ (0xCA7A106 + k))
        return hash64(items, salt) & ((1 << RAW_ID_BITS) - 1)

    def _generate(self, indices: torch.Tensor):
        idx = torch.as_tensor(indices, dtype=torch.int64).reshape(-1)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.size):
            raise IndexError(f"index out of range [0, {self.size})")
        keys = idx.unsqueeze(1) * self.fields + torch.arange(self.fields)
        u = _uniform(keys, self.salt)  # (B, fields)
        x, logit = {}, torch.full((idx.numel(),), float(self.bias), dtype=torch.float64)
        for k, n in enumerate(self.ranks):
            if self.raw_ids:
                ids = self._raw_ids(k, self._zipf_rank(u[:, k], n), idx)
            else:
                a, b = self.shuffles[k]
                ids = (self._zipf_rank(u[:, k], n) * a + b).remainder_(n)
            x[f"cat_{k}"] = ids
            logit += self._id_weight(k, ids)
        k0 = len(self.cards)
        dense = math.sqrt(2.0) * torch.erfinv(2 * u[:, k0:k0 + self.num_dense] - 1)
        logit += dense @ self.dense_weights
        x["dense"] = dense.float()
        y = (u[:, -1] < torch.sigmoid(logit)).float()
        return x, y, logit

    def batch(self, indices: torch.Tensor):
        x, y, _ = self._generate(indices)
        return x, y

    def logits(self, indices: torch.Tensor) -> torch.Tensor:
        """The hidden model's logits (float64): the best any model can do on these labels."""
        return self._generate(indices)[2]

    def __getitem__(self, i: int):
        x, y = self.batch(torch.tensor([i]))
        return {k: v[0] for k, v in x.items()}, y[0]

    def __getitems__(self, indices: list[int]) -> list:
        x, y = self.batch(torch.as_tensor(indices, dtype=torch.int64))
        return [({k: v[j] for k, v in x.items()}, y[j]) for j in range(len(y))]


def clicks(num_samples: int, test_samples: int, cardinalities: list[int], num_dense: int = 13,
           zipf_alpha: float = 1.05, seed: int = 0, signal: float = 2.0,
           bias: float = -1.0, raw_ids: bool = False, distinct_ids: int = 100_000,
           drift: float = 0.0) -> dict:
    """Synthetic click logs (see `ClickLogs`): categorical features `cat_0`..`cat_{K-1}` with
    power-law ids over `cardinalities`, `num_dense` dense features, a learnable label.

    `raw_ids`: K = len(cardinalities) features of raw ids in [0, 2^40), `distinct_ids` catalogue
    items live at a time, the head moving `drift` items per training sample; the test split is
    the catalogue at the end of training (time `num_samples`). The tables then hash the raw ids
    into `distinct_ids` rows each."""
    if not cardinalities or any(n <= 0 or n >= 1 << 31 for n in cardinalities):
        raise ValueError(f"data.cardinalities={list(cardinalities)}: need at least one, each in "
                         "[1, 2^31)")
    if zipf_alpha <= 0:
        raise ValueError(f"data.zipf_alpha={zipf_alpha}: must be positive")
    if isinstance(distinct_ids, bool) or not isinstance(distinct_ids, int) or distinct_ids < 1:
        raise ValueError(f"data.distinct_ids={distinct_ids!r}: must be an integer >= 1 (the "
                         "number of catalogue items each raw-id feature draws from)")
    if not (isinstance(drift, (int, float)) and 0 <= drift < math.inf):
        raise ValueError(f"data.drift={drift!r}: must be a finite number >= 0 (catalogue items "
                         "per training sample; 0: a fixed catalogue)")
    if drift and not raw_ids:
        raise ValueError(f"data.drift={drift}: drift needs data.raw_ids=true (the catalogue of "
                         "raw ids is what drifts); set data.raw_ids=true or data.drift=0")
    common = dict(cardinalities=cardinalities, num_dense=num_dense, zipf_alpha=zipf_alpha,
                  seed=seed, signal=signal, bias=bias)
    if raw_ids:
        common.update(raw_ids=True, distinct_ids=distinct_ids, drift=drift)
        tables = [{"name": f"cat_{k}", "num_rows": distinct_ids, "hash_size": distinct_ids}
                  for k in range(len(cardinalities))]
    else:
        tables = [{"name": f"cat_{k}", "num_rows": n} for k, n in enumerate(cardinalities)]
    test_now = {"now": num_samples} if raw_ids else {}  # the catalogue at the end of training
    return {"train": ClickLogs(num_samples, split=0, **common),
            "test": (ClickLogs(test_samples, split=1, **common, **test_now)
                     if test_samples else None),
            "num_dense": num_dense, "tables": tables}
