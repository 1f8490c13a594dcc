"""Dynamic tables (sparse.dynamic=true) on the recsys datasets as they are read: Criteo's raw
categorical ids reach the tables unhashed (a row per id, not per hash bucket), and MovieLens
trains with every table dynamic."""

import math

import pytest
import torch

from psrpc import factories
from psrpc.metrics import AUCLogLoss
from psrpc.recsys.data import CRITEO_MISSING
from psrpc.sparse import DynamicBag, load_model, load_tables
from tests.conftest import compose, run_cluster
from tests.test_recsys import write_criteo
from tests.test_sparse_cluster import MOVIELENS

pytestmark = pytest.mark.timeout(300)
DLRM = ["model=dlrm", "model.dim=8", "model.bottom=[16,8]", "model.top=[16]", "loss=bce",
        "metric=auc", "train.untimed_steps=2", "update.timeout_s=30"]
HASH_SIZE = 1000


def test_criteo_raw_ids_reach_dynamic_tables_unhashed(tmp_path):
    """The reader gives raw ids (int(hex, 16), a missing value 2^62) and leaves the hashing to
    the tables (TableSpec.hash_size): with sparse.dynamic the tables take the raw ids as they
    are, one row per id the run trained, and serve the test split as the run evaluated it."""
    path = tmp_path / "day_0"
    write_criteo(path, n=400)
    # 360 training lines; 12 steps of 2 × 16 go over all of them (one epoch and a bit)
    overrides = DLRM + ["data=criteo", f"data.path={path}", f"data.hash_size={HASH_SIZE}",
                        "sparse.dynamic=true", "cluster.num_workers=2", "train.batch_size=16",
                        "train.steps=12", "train.log_every=6"]
    summary, _ = run_cluster(tmp_path / "run", overrides, fast=False)
    assert summary["steps"] == 12 and math.isfinite(summary["test_auc"])
    tables = load_tables(tmp_path / "run")
    assert sorted(summary["tables"]) == sorted(tables) == sorted(f"C{k}" for k in range(1, 27))
    cfg = compose(overrides, check=False)
    data = factories.load_data(cfg)
    train = data.train.features
    for name, bag in tables.items():
        assert isinstance(bag, DynamicBag), name
        assert summary["tables"][name]["rows_live"] == bag.ids.numel() > 0, name
        # every id trained has its row, by raw id: the reader's ids, not hash buckets
        assert torch.equal(bag.ids, torch.unique(train[name])), name
    assert any(int(bag.ids.max()) >= HASH_SIZE for bag in tables.values())
    assert any(bool((bag.ids == CRITEO_MISSING).any()) for bag in tables.values())
    # served outside psrpc: the test split scores as the run's evaluation scored it
    model = load_model(factories.build_model(cfg, data, remote_tables=False),
                       str(tmp_path / "run"))
    metric = AUCLogLoss()
    with torch.no_grad():
        x, y = data.test.batch(torch.arange(len(data.test)))
        metric.update(model(x), y)
    assert abs(metric.compute()["auc"] - summary["test_auc"]) < 1e-5


@pytest.mark.skipif(not (MOVIELENS / "ml-100k.inter").is_file(), reason="needs ../shared/data")
def test_movielens_dlrm_with_every_table_dynamic(tmp_path):
    """The vocabulary ids of the MovieLens reader (row 0: unseen in training; genres
    multi-valued, padded with -1) as a dynamic table's raw ids: a short run ends with a finite
    test AUC and a row per id it trained."""
    summary, _ = run_cluster(tmp_path, ["+experiment=movielens_dlrm", f"data.root={MOVIELENS}",
                                        "sparse.dynamic=true", "train.steps=30",
                                        "train.log_every=15", "train.eval_every=0"], fast=False)
    assert summary["steps"] == 30 and math.isfinite(summary["test_auc"])
    assert 0 < summary["test_auc"] < 1
    tables = load_tables(tmp_path)
    for name, rows in summary["tables"].items():
        assert rows["rows_live"] == rows["rows_created"] > 0 and rows["rows_evicted"] == 0
        bag = tables[name]
        assert isinstance(bag, DynamicBag) and bag.ids.numel() == rows["rows_live"], name
        # training ids are vocabulary ids 1..V: no row for the padding (-1) or "unseen" (0)
        assert int(bag.ids.min()) >= 1, name
