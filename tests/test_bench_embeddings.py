"""benchmarks/embeddings.py's peers at toy sizes: the single process and TorchRec's
DistributedModelParallel train, TorchRec's tables compute what psrpc's do, and a machine without
TorchRec gets a skipped row instead of a crash. The TorchRec tests skip where it is not installed
(benchmarks/README.md says how to install it)."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from benchmarks import embeddings
from benchmarks.common import ROOT, bench_config, psrpc_config
from psrpc.sparse.rows import TableSpec
from psrpc.sparse.tables import EmbeddingTables

TINY = ["rows=[1000]", "batch_size=32", "steps=4", "warmup=1"]


def _cfg():
    b = bench_config("embeddings", TINY)
    return psrpc_config(embeddings.overrides(b, b.rows[0], b.steps))


def test_without_torchrec_its_row_says_skipped(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torchrec", None)  # `import torchrec` fails as if absent
    argv = [*TINY, "systems=[torchrec]", f"out={tmp_path}"]
    monkeypatch.setattr(sys, "argv", [str(ROOT / "benchmarks" / "embeddings.py"), *argv])
    monkeypatch.setattr(embeddings, "plot", None)  # no plot: matplotlib is the bench extra's
    embeddings.main(argv)
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert rows == [{"rows": 1000, "system": "torchrec",
                     "note": "skipped: torchrec not installed"}]


def test_single_process_trains():
    assert embeddings.single(_cfg())["samples_per_s"] > 0


def test_torchrec_tables_compute_psrpc_tables():
    """The same rows give the same pooled vectors: sum and mean pooling, padded multi-valued
    features, hashed ids."""
    pytest.importorskip("torchrec")
    specs = [TableSpec("a", 50, 4), TableSpec("b", 30, 4, pooling="mean"),
             TableSpec("c", 20, 4, hash_size=20)]
    ours = EmbeddingTables(specs, seed=3)
    theirs = embeddings.TorchRecTables(specs)
    theirs.ebc.to_empty(device="cpu")
    with torch.no_grad():
        for s in specs:
            theirs.ebc.embedding_bags[s.name].weight.copy_(ours.bags[s.name].weight)
    features = {"a": torch.tensor([3, 49, 0]),
                "b": torch.tensor([[1, 2, -1], [-1, -1, -1], [29, 0, 5]]),
                "c": torch.tensor([[123456789, -1], [7, 8], [-5, 2**40]])}
    expected, got = ours(features), theirs(features)
    for s in specs:
        torch.testing.assert_close(got[s.name], expected[s.name])


def test_torchrec_peer_trains():
    pytest.importorskip("torchrec")
    assert embeddings.torchrec(_cfg())["samples_per_s"] > 0
