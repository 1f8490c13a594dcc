"""Click-prediction datasets: factories returning `{"train", "test", "num_dense", "tables"}`.

Items are `(x, y)`: x a dict of tensors ("dense": float32 (D,); one int64 id tensor per
categorical feature, named as its table: a scalar, or (L,) padded with -1 when multi-valued), y a
float32 0./1. scalar. Batches come from `torch.utils.data.default_collate`; every dataset here
also has `batch(indices)`, which gives the same batch in one vectorised call, and
`__getitems__`, which DataLoader uses to fetch a batch that way.

- `movielens(root)`: MovieLens 100K in RecBole's atomic layout, rating >= 4 is a click, split by
  time.
- `clicks(...)`: synthetic click logs with Zipf-distributed ids over any cardinalities, computed
  per index from the seed (no memory, any size), labels from a hidden logistic model
  (`psrpc/recsys/synthetic.py`).
- `criteo(path)`: the Criteo TSV layout (label, 13 integers, 26 hex categoricals).
"""

from __future__ import annotations

import csv
import math
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import torch
from torch.utils.data import Dataset, default_collate

from psrpc.recsys.synthetic import ClickLogs, clicks

__all__ = ["TensorDictDataset", "batches", "movielens", "clicks", "ClickLogs", "criteo"]

PAD = -1


class TensorDictDataset(Dataset):
    """Whole tensors in memory: item i is ({name: features[name][i]}, labels[i])."""

    def __init__(self, features: dict[str, torch.Tensor], labels: torch.Tensor):
        self.features, self.labels = features, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i):
        return {k: v[i] for k, v in self.features.items()}, self.labels[i]

    def batch(self, indices: torch.Tensor):
        """The batch `default_collate([self[i] for i in indices])` gives, in one indexing."""
        return {k: v[indices] for k, v in self.features.items()}, self.labels[indices]

    def __getitems__(self, indices: list[int]) -> list:
        return _unbatch(*self.batch(torch.as_tensor(indices, dtype=torch.int64)))


def _unbatch(x: dict, y: torch.Tensor) -> list:
    return [({k: v[j] for k, v in x.items()}, y[j]) for j in range(len(y))]


def batches(dataset, batch_size: int, shuffle: bool = False,
            generator: Optional[torch.Generator] = None) -> Iterator:
    """(x, y) batches of `dataset` in order or shuffled by `generator`: `dataset.batch` when it
    has one, `default_collate` of the items otherwise."""
    n = len(dataset)
    order = torch.randperm(n, generator=generator) if shuffle else torch.arange(n)
    for start in range(0, n, batch_size):
        idx = order[start:start + batch_size]
        if hasattr(dataset, "batch"):
            yield dataset.batch(idx)
        else:
            yield default_collate([dataset[i] for i in idx.tolist()])


# ---------------------------------------------------------------- MovieLens 100K

AGE_BUCKETS = (18, 25, 35, 45, 50, 56)  # MovieLens 1M's age groups: <18, 18-24, ..., 56+
ML_FEATURES = ("user", "item", "age", "gender", "occupation", "zip", "genres", "year")


def _read_atomic(path: Path) -> dict[str, list[str]]:
    """A RecBole atomic file: tab-separated, header fields `name:type`; columns by name."""
    with open(path, newline="", encoding="utf-8", errors="replace") as f:
        rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    names = [h.split(":")[0] for h in rows[0]]
    cols = {n: [] for n in names}
    for line_no, row in enumerate(rows[1:], start=2):
        if len(row) != len(names):
            raise ValueError(f"{path}:{line_no}: {len(row)} fields, the header has {len(names)}")
        for n, v in zip(names, row):
            cols[n].append(v)
    return cols


def _vocab(tokens_in_train) -> dict[str, int]:
    """Tokens seen in training -> rows 1..V in sorted order; row 0 is every unseen token."""
    return {t: i + 1 for i, t in enumerate(sorted(set(tokens_in_train)))}


def movielens(root: str, test_fraction: float = 0.2) -> dict:
    """MovieLens 100K from `root`/ml-100k.{inter,user,item} (RecBole's atomic files).

    - Label: rating >= 4 (55,375 of 100,000 ratings).
    - Split by time over all ratings: sorted by timestamp (ties by order in the file, a stable
      sort), the last round(N * test_fraction) ratings are the test set.
    - Categorical features, each its own table: user, item, age (MovieLens 1M's 7 age groups),
      gender, occupation, zip (first 3 characters), genres (multi-valued, padded with -1 to the
      most genres any movie has; mean pooling), year (release year; a missing or malformed year
      is the token "unknown"). Ids come from vocabularies of the training split: row 0 of every
      table is "unseen in training" (test users who rated nothing before the cut land there).
    - Dense features (D = 2): age and release year, standardised with the training split's mean
      and std (a missing year is 0, the mean).
    """
    inter, user_info, item_info = _read_movielens(root, test_fraction)
    n = len(inter["user_id"])
    timestamps = torch.tensor([float(t) for t in inter["timestamp"]], dtype=torch.float64)
    order = torch.argsort(timestamps, stable=True).tolist()
    num_test = round(n * test_fraction)
    splits = {"train": order[:n - num_test], "test": order[n - num_test:]}
    rows = [_movielens_tokens(inter["user_id"][k], inter["item_id"][k], user_info, item_info)
            for k in range(n)]
    labels = torch.tensor([float(r) for r in inter["rating"]]) >= 4
    encode = _MovieLensEncoding.of([rows[k] for k in splits["train"]],
                                   max(len(g) for _, g in item_info.values()))
    tables = [{"name": f, "num_rows": len(encode.vocabs[f]) + 1} for f in ML_FEATURES]
    tables[ML_FEATURES.index("genres")]["pooling"] = "mean"
    return {"train": encode(rows, splits["train"], labels),
            "test": encode(rows, splits["test"], labels), "num_dense": 2, "tables": tables}


def _read_movielens(root: str, test_fraction: float) -> tuple[dict, dict, dict]:
    """The ratings, {user: (age, gender, occupation, zip3)}, {item: (year, genres)}."""
    root_path = Path(root)
    if not 0 < test_fraction < 1:
        raise ValueError(f"data.test_fraction={test_fraction}: must lie in (0, 1)")
    for name in ("ml-100k.inter", "ml-100k.user", "ml-100k.item"):
        if not (root_path / name).is_file():
            raise ValueError(f"data.root={root}: no {name} there")
    inter = _read_atomic(root_path / "ml-100k.inter")
    users = _read_atomic(root_path / "ml-100k.user")
    items = _read_atomic(root_path / "ml-100k.item")
    user_info = {u: (int(a), g, o, z[:3]) for u, a, g, o, z in zip(
        users["user_id"], users["age"], users["gender"], users["occupation"], users["zip_code"])}
    item_info = {i: (y if len(y) == 4 and y.isdigit() else "unknown", genres.split())
                 for i, y, genres in zip(items["item_id"], items["release_year"], items["class"])}
    return inter, user_info, item_info


def _movielens_tokens(u: str, i: str, user_info: dict, item_info: dict) -> dict:
    """One rating's tokens per feature, and its raw age and year (for the dense features)."""
    age, gender, occupation, zip3 = user_info[u]
    year, genres = item_info[i]
    age_group = str(sum(age >= b for b in AGE_BUCKETS))
    return {"user": u, "item": i, "age": age_group, "gender": gender,
            "occupation": occupation, "zip": zip3, "genres": genres, "year": year,
            "_age": float(age), "_year": float(year) if year != "unknown" else math.nan}


@dataclass
class _MovieLensEncoding:
    """What the training split fixes: each feature's vocabulary, the dense features' mean and
    std, the most genres a movie has (the padded width)."""

    vocabs: dict[str, dict[str, int]]
    stats: dict[str, tuple[torch.Tensor, torch.Tensor]]
    max_genres: int

    @classmethod
    def of(cls, train_rows: list[dict], max_genres: int) -> "_MovieLensEncoding":
        vocabs = {f: _vocab(t for r in train_rows for t in (r[f] if f == "genres" else [r[f]]))
                  for f in ML_FEATURES}
        ages = torch.tensor([r["_age"] for r in train_rows])
        years = torch.tensor([r["_year"] for r in train_rows])
        years = years[~years.isnan()]
        stats = {"_age": (ages.mean(), ages.std()), "_year": (years.mean(), years.std())}
        return cls(vocabs, stats, max_genres)

    def __call__(self, rows: list[dict], ks: list[int], labels: torch.Tensor) -> TensorDictDataset:
        feats = {f: torch.tensor([self.vocabs[f].get(rows[k][f], 0) for k in ks],
                                 dtype=torch.int64)
                 for f in ML_FEATURES if f != "genres"}
        genres = [[self.vocabs["genres"].get(t, 0) for t in rows[k]["genres"]] for k in ks]
        feats["genres"] = torch.tensor([g + [PAD] * (self.max_genres - len(g)) for g in genres],
                                       dtype=torch.int64)
        dense = []
        for key in ("_age", "_year"):
            mean, std = self.stats[key]
            col = (torch.tensor([rows[k][key] for k in ks]) - mean) / std
            dense.append(col.nan_to_num_(0.0))
        feats["dense"] = torch.stack(dense, 1).float()
        return TensorDictDataset(feats, labels[ks].float())


# ---------------------------------------------------------------- Criteo TSV

CRITEO_INTS, CRITEO_CATS = 13, 26
CRITEO_MISSING = 1 << 62  # the raw id of a missing categorical value (hex values are 32-bit)


def criteo(path: str, test_fraction: float = 0.1, hash_size: int = 1_000_000,
           max_rows: Optional[int] = None) -> dict:
    """The Criteo TSV layout (Kaggle's train.txt, the 1TB logs' day_N): per line a 0/1 label,
    13 integer features, 26 categorical features as hex strings, tab-separated, empty = missing.

    Integers -> dense log(1 + x) (negative or missing: 0). Categoricals -> raw ids
    int(hex, 16) (missing: CRITEO_MISSING), hashed by each table (`hash_size` rows, tables
    C1..C26 with hash_size set). The last `test_fraction` of the lines are the test set (the
    logs are in time order). `max_rows`: read only the first lines. Everything is held in
    memory: 8 bytes x 26 ids per line.
    """
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"data.path={path}: no such file")
    if not 0 <= test_fraction < 1:
        raise ValueError(f"data.test_fraction={test_fraction}: must lie in [0, 1)")
    labels, ints, cats = array("f"), array("d"), array("q")
    width = 1 + CRITEO_INTS + CRITEO_CATS
    with open(p, encoding="ascii", errors="replace") as f:
        for line_no, line in enumerate(f, start=1):
            if max_rows is not None and line_no > max_rows:
                break
            fields = line.rstrip("\r\n").split("\t")
            if len(fields) != width:
                raise ValueError(f"data.path={path}:{line_no}: {len(fields)} fields, expected "
                                 f"{width} (label, 13 integers, 26 categoricals)")
            try:
                label = int(fields[0])
                if label not in (0, 1):
                    raise ValueError(f"label {fields[0]!r}, expected 0 or 1 (a click or not)")
                labels.append(float(label))
                for v in fields[1:1 + CRITEO_INTS]:
                    x = int(v) if v else 0
                    ints.append(math.log1p(x) if x > 0 else 0.0)
                for v in fields[1 + CRITEO_INTS:]:
                    cats.append(int(v, 16) % CRITEO_MISSING if v else CRITEO_MISSING)
            except ValueError as e:
                raise ValueError(f"data.path={path}:{line_no}: {e}") from None
    n = len(labels)
    if n == 0:
        raise ValueError(f"data.path={path}: no lines")
    y = torch.frombuffer(labels, dtype=torch.float32).clone()
    dense = torch.frombuffer(ints, dtype=torch.float64).reshape(n, CRITEO_INTS).float()
    ids = torch.frombuffer(cats, dtype=torch.int64).reshape(n, CRITEO_CATS).clone()
    num_test = round(n * test_fraction)

    def part(lo: int, hi: int) -> TensorDictDataset:
        feats = {f"C{k + 1}": ids[lo:hi, k] for k in range(CRITEO_CATS)}
        feats["dense"] = dense[lo:hi]
        return TensorDictDataset(feats, y[lo:hi])

    tables = [{"name": f"C{k + 1}", "num_rows": hash_size, "hash_size": hash_size}
              for k in range(CRITEO_CATS)]
    return {"train": part(0, n - num_test), "test": part(n - num_test, n) if num_test else None,
            "num_dense": CRITEO_INTS, "tables": tables}
