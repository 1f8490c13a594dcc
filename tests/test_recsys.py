"""psrpc.recsys.data and .reference: MovieLens 100K (read from shared/data, skipped without it),
synthetic Zipf click logs, the Criteo TSV reader, the logistic regression baseline."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, default_collate

from psrpc.metrics import roc_auc
from psrpc.recsys.data import CRITEO_MISSING, clicks, criteo, movielens
from psrpc.recsys.reference import logistic_regression_auc

ML_ROOT = Path(__file__).resolve().parents[2] / "shared" / "data" / "ml-100k"


@pytest.fixture(scope="module")
def ml():
    if not (ML_ROOT / "ml-100k.inter").is_file():
        pytest.skip(f"needs MovieLens 100K at {ML_ROOT}")
    return movielens(str(ML_ROOT))


def check_ids_within_tables(data: dict) -> None:
    for part in ("train", "test"):
        x, _ = data[part].batch(torch.arange(len(data[part])))
        for table in data["tables"]:
            ids = x[table["name"]]
            real = ids[ids != -1]
            assert int(real.min()) >= 0 and int(real.max()) < table["num_rows"], table


def test_movielens_counts_and_split(ml):
    train, test = ml["train"], ml["test"]
    assert len(train) + len(test) == 100_000 and len(test) == 20_000
    assert int(train.labels.sum() + test.labels.sum()) == 55_375
    assert ml["num_dense"] == 2
    assert [t["name"] for t in ml["tables"]] == ["user", "item", "age", "gender", "occupation",
                                                 "zip", "genres", "year"]
    check_ids_within_tables(ml)
    x, y = train[0]
    assert y.dtype == torch.float32 and x["dense"].shape == (2,) and x["genres"].shape == (6,)


def test_movielens_time_split(ml):
    """Train is the first 80 % of all ratings in time order (ties in file order), test the rest,
    each in that order; ids come from vocabularies of the training split, row 0 = unseen."""
    import csv

    with open(ML_ROOT / "ml-100k.inter") as f:
        rows = list(csv.reader(f, delimiter="\t"))[1:]
    order = sorted(range(len(rows)), key=lambda k: float(rows[k][3]))  # stable
    train_rows, test_rows = [rows[k] for k in order[:80_000]], [rows[k] for k in order[80_000:]]
    assert max(float(r[3]) for r in train_rows) <= min(float(r[3]) for r in test_rows)
    for part, part_rows in (("train", train_rows), ("test", test_rows)):
        want = torch.tensor([float(float(r[2]) >= 4) for r in part_rows])
        assert torch.equal(ml[part].labels, want), part
    vocab = {t: i + 1 for i, t in enumerate(sorted({r[1] for r in train_rows}))}
    for part, part_rows in (("train", train_rows), ("test", test_rows)):
        want = torch.tensor([vocab.get(r[1], 0) for r in part_rows])
        assert torch.equal(ml[part].features["item"], want), part
    assert int((ml["train"].features["user"] == 0).sum()) == 0
    assert int((ml["test"].features["user"] == 0).sum()) > 0  # users first seen after the cut


def test_movielens_missing_data_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match=f"data.root={tmp_path}: no ml-100k.inter there"):
        movielens(str(tmp_path))


def test_items_collate_like_batch(ml):
    idx = [5, 17, 42]
    want_x, want_y = ml["train"].batch(torch.tensor(idx))
    got_x, got_y = default_collate([ml["train"][i] for i in idx])
    assert torch.equal(got_y, want_y) and got_x.keys() == want_x.keys()
    assert all(torch.equal(got_x[k], want_x[k]) for k in want_x)
    x, y = next(iter(DataLoader(ml["train"], batch_size=3)))  # through __getitems__
    assert torch.equal(x["genres"], ml["train"].batch(torch.arange(3))[0]["genres"])


CARDS = [50, 1000, 20_000_000]


def test_clicks_deterministic_and_within_cardinalities():
    a = clicks(2000, 500, CARDS, num_dense=4, seed=3)
    b = clicks(2000, 500, CARDS, num_dense=4, seed=3)
    idx = torch.arange(2000)
    xa, ya = a["train"].batch(idx)
    xb, yb = b["train"].batch(idx)
    assert torch.equal(ya, yb) and all(torch.equal(xa[k], xb[k]) for k in xa)
    assert a["tables"] == [{"name": f"cat_{k}", "num_rows": n} for k, n in enumerate(CARDS)]
    for k, n in enumerate(CARDS):
        assert int(xa[f"cat_{k}"].min()) >= 0 and int(xa[f"cat_{k}"].max()) < n
    x, y = a["train"][7]  # one item equals row 7 of the batch
    assert torch.equal(y, ya[7]) and all(torch.equal(x[k], xa[k][7]) for k in x)
    assert x["dense"].shape == (4,) and y.dtype == torch.float32
    xt, _ = a["test"].batch(torch.arange(500))  # a different stream from train
    assert not torch.equal(xt["cat_1"], xa["cat_1"][:500])
    xc, _ = clicks(2000, 0, CARDS, num_dense=4, seed=4)["train"].batch(idx)
    assert not torch.equal(xc["cat_1"], xa["cat_1"])


def test_clicks_zipf_skew_and_spread():
    data = clicks(20_000, 0, [10_000], num_dense=0, zipf_alpha=1.05, seed=0)
    ids = data["train"].batch(torch.arange(20_000))[0]["cat_0"]
    counts = torch.bincount(ids, minlength=10_000).sort(descending=True).values
    top_share = float(counts[:100].sum()) / 20_000  # the top 1 % of ids
    assert top_share > 0.35, top_share
    popular = torch.bincount(ids, minlength=10_000).argsort(descending=True)[:10]
    assert float(popular.float().mean()) > 1000  # shuffled: popular ids are not 0, 1, 2, ...


def test_clicks_learnable():
    data = clicks(4000, 0, [100, 5000], num_dense=3, seed=1)
    ds = data["train"]
    idx = torch.arange(4000)
    _, y = ds.batch(idx)
    assert 0.15 < float(y.mean()) < 0.6
    assert roc_auc(ds.logits(idx), y) > 0.75  # the hidden model on its own labels


def test_clicks_errors():
    with pytest.raises(ValueError, match="data.cardinalities"):
        clicks(10, 0, [])
    with pytest.raises(ValueError, match="data.zipf_alpha"):
        clicks(10, 0, [5], zipf_alpha=0)
    with pytest.raises(IndexError):
        clicks(10, 0, [5])["train"][10]


RAW = dict(num_dense=2, raw_ids=True, distinct_ids=1000, seed=1)


def _ids(ds, lo: int, hi: int, feature: str = "cat_0") -> torch.Tensor:
    return ds.batch(torch.arange(lo, hi))[0][feature]


def test_clicks_raw_ids_are_40_bit_deterministic_and_hashed_by_the_model():
    from psrpc.recsys.dlrm import make_dlrm

    a, b = (clicks(3000, 500, [1, 1, 1], drift=0.1, **RAW) for _ in range(2))
    assert a["tables"] == [{"name": f"cat_{k}", "num_rows": 1000, "hash_size": 1000}
                           for k in range(3)]
    for part in ("train", "test"):
        idx = torch.arange(len(a[part]))
        (xa, ya), (xb, yb) = a[part].batch(idx), b[part].batch(idx)
        assert torch.equal(ya, yb) and all(torch.equal(xa[k], xb[k]) for k in xa)
        for k in range(3):
            ids = xa[f"cat_{k}"]
            assert ids.dtype == torch.int64 and int(ids.min()) >= 0 and int(ids.max()) < 2 ** 40
        assert int(xa["cat_0"].max()) >= 2 ** 32  # raw ids, not rows
    assert not torch.equal(xa["cat_0"], xa["cat_1"])  # each feature its own catalogue
    model = make_dlrm(2, a["tables"], bottom=[8], top=[8], dim=8)
    assert model(a["train"].batch(torch.arange(64))[0]).shape == (64,)
    y = a["train"].batch(torch.arange(3000))[1]
    assert roc_auc(a["train"].logits(torch.arange(3000)), y) > 0.75  # still learnable
    # the old mode is untouched by the new defaults
    assert torch.equal(_ids(clicks(100, 0, [50], raw_ids=False, distinct_ids=7)["train"], 0, 100),
                       _ids(clicks(100, 0, [50])["train"], 0, 100))


def _head(ids: torch.Tensor, n: int = 10) -> set:
    """The n most frequent ids."""
    values, counts = torch.unique(ids, return_counts=True)
    return set(values[counts.argsort(descending=True, stable=True)[:n]].tolist())


def test_clicks_drift_brings_new_ids_over_time():
    head = {}
    for drift in (0.0, 1.0):
        train = clicks(60_000, 0, [1], drift=drift, **RAW)["train"]
        early, late = _ids(train, 0, 2000), _ids(train, 50_000, 52_000)
        shared = len(set(early.tolist()) & set(late.tolist()))
        head[drift] = [_head(early, 3), _head(late, 10)]
        if drift:
            assert shared == 0, shared  # the catalogue has moved on by 50,000 items
        else:
            assert shared > 200, shared
    assert head[0.0][0] <= head[0.0][1]  # a fixed catalogue: the same head ids
    assert not head[1.0][0] & head[1.0][1]


def test_clicks_raw_test_split_is_the_catalogue_at_the_end_of_training():
    n = 50_000
    data = clicks(n, 2000, [1], drift=0.05, **RAW)
    test = _ids(data["test"], 0, 2000).tolist()
    last = set(_ids(data["train"], n - 2000, n).tolist())
    first = set(_ids(data["train"], 0, 2000).tolist())
    assert sum(i in last for i in test) > 0.6 * len(test)
    assert not any(i in first for i in test)
    # the test split's time is num_samples: it moves with the training length (not with drift 0)
    for drift, moves in ((0.05, True), (0.0, False)):
        a, b = (_ids(clicks(m, 500, [1], drift=drift, **RAW)["test"], 0, 500)
                for m in (n, 2 * n))
        assert torch.equal(a, b) != moves


def test_clicks_raw_id_errors():
    for bad in (0, -5, 2.5):
        with pytest.raises(ValueError, match=r"data.distinct_ids=.*integer >= 1"):
            clicks(10, 0, [1], raw_ids=True, distinct_ids=bad)
    for bad in (-0.1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"data.drift=.*>= 0"):
            clicks(10, 0, [1], raw_ids=True, drift=bad)
    with pytest.raises(ValueError, match=r"data.drift=0.5: drift needs data.raw_ids=true"):
        clicks(10, 0, [1], drift=0.5)


def test_hidden_auc_in_chunks_equals_the_whole_split():
    from psrpc.session.outputs import hidden_auc

    test = clicks(10, 3000, [100, 5000], num_dense=3, seed=1)["test"]
    idx = torch.arange(3000)
    whole = roc_auc(test.logits(idx).float(), test.batch(idx)[1])
    assert hidden_auc(test, chunk=700) == hidden_auc(test) == {"hidden_auc": round(whole, 6)}
    assert 0.5 < whole < 1
    assert hidden_auc(None) == {"hidden_auc": None}
    assert hidden_auc(torch.utils.data.TensorDataset(torch.zeros(3))) == {"hidden_auc": None}


def write_criteo(path: Path, n: int = 40) -> list[list[str]]:
    g = torch.Generator().manual_seed(0)
    lines = []
    for i in range(n):
        label = str(int(torch.rand(1, generator=g) < 0.3))
        ints = [str(int(torch.randint(-3, 500, (1,), generator=g))) for _ in range(13)]
        cats = [f"{int(torch.randint(0, 2**32, (1,), generator=g)):08x}" for _ in range(26)]
        if i % 3 == 0:  # some missing values
            ints[i % 13] = ""
            cats[i % 26] = ""
        lines.append([label, *ints, *cats])
    path.write_text("".join("\t".join(f) + "\n" for f in lines))
    return lines


def test_criteo_reads_the_tsv_layout(tmp_path):
    path = tmp_path / "day_0"
    lines = write_criteo(path)
    data = criteo(str(path), test_fraction=0.25, hash_size=1000)
    train, test = data["train"], data["test"]
    assert len(train) == 30 and len(test) == 10 and data["num_dense"] == 13
    assert data["tables"][0] == {"name": "C1", "num_rows": 1000, "hash_size": 1000}
    assert len(data["tables"]) == 26
    x, y = test[3]  # line 34
    line = lines[33]
    assert float(y) == float(line[0])
    for k in range(13):
        v = int(line[1 + k]) if line[1 + k] else 0
        assert float(x["dense"][k]) == pytest.approx(math.log1p(v) if v > 0 else 0.0)
    for k in range(26):
        v = line[14 + k]
        assert int(x[f"C{k + 1}"]) == (int(v, 16) if v else CRITEO_MISSING)
    assert train[0][0]["dense"][0] == 0.0 and int(train[0][0]["C1"]) == CRITEO_MISSING  # line 1
    # the tables hash raw ids into [0, hash_size)
    from psrpc.recsys.dlrm import make_dlrm

    model = make_dlrm(13, data["tables"], dim=4, bottom=[8, 4], top=[8])
    assert model(train.batch(torch.arange(5))[0]).shape == (5,)


def test_criteo_errors(tmp_path):
    with pytest.raises(ValueError, match="data.path=.*no such file"):
        criteo(str(tmp_path / "nothing"))
    bad = tmp_path / "bad"
    bad.write_text("1\t2\t3\n")
    with pytest.raises(ValueError, match=r"bad:1: 3 fields, expected 40"):
        criteo(str(bad))
    lines = write_criteo(bad, n=3)
    lines[2][0] = "2"  # a count, not a click: the loss would train on nonsense
    bad.write_text("".join("\t".join(f) + "\n" for f in lines))
    with pytest.raises(ValueError, match=r"bad:3: label '2', expected 0 or 1"):
        criteo(str(bad))


def test_logistic_regression_beats_chance_on_movielens(ml):
    """The defaults (5 epochs): AUC 0.693, about 5 s of one core."""
    auc = logistic_regression_auc(ml["train"], ml["test"], tables=ml["tables"],
                                  num_dense=ml["num_dense"])
    assert auc > 0.68, auc


def test_logistic_regression_learns_clicks_deterministically():
    data = clicks(6000, 2000, [20, 300], num_dense=2, seed=2)
    runs = [logistic_regression_auc(data["train"], data["test"], epochs=2, lr=0.1,
                                    tables=data["tables"], num_dense=2) for _ in range(2)]
    assert runs[0] == runs[1]
    best = roc_auc(data["test"].logits(torch.arange(2000)), data["test"].batch(
        torch.arange(2000))[1])
    assert 0.6 < runs[0] <= best + 0.02, (runs[0], best)
