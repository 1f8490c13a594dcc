"""Dynamic embedding tables: train on click logs of raw ids from a drifting catalogue, then
serve the trained rows without psrpc.

    python examples/dynamic_tables.py [--out DIR] [--steps N]

1. `psrpc.train`: DLRM on synthetic click logs of raw 40-bit ids (`data.raw_ids=true`) from a
   catalogue that drifts (`data.drift`: new items take the head of the popularity ranking
   along the log, so the log names many more items than are live at any time), read in time
   order (`train.shuffle=false`), as a click log is replayed. With
   `sparse.dynamic=true` every table keeps a row per raw id it has trained (no hashing into a
   fixed number of rows, so no collisions), and `sparse.evict=lfu` caps each table at
   `sparse.max_rows` rows, dropping the least often seen ids: memory stays bounded however
   many ids the log names. The servers write the rows to DIR/tables/, the dense layers to
   DIR/model.pt; summary.json counts each table's rows (created, evicted, live).
2. `write_heldout`: the test split (the catalogue at the end of the log) as plain tensors,
   DIR/heldout.pt.
3. `serve`: no parameter server and no RPC, only DIR and the config. The model as the config
   builds it outside psrpc (`psrpc.factories.build_model(..., remote_tables=False)`: each
   dynamic table a `DynamicBag`, looked up by raw id); `psrpc.sparse.load_model` puts the
   run's rows and dense layers in it, and it scores the held-out file. An id with no row
   (never trained, or evicted) reads as its initial value, as the servers would have given
   it, so the AUC is the run's `test_auc` to rounding. `hidden_auc` is the AUC of the hidden
   model that drew the labels: the most any model can reach on this test split.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import psrpc
from psrpc import factories
from psrpc.metrics import AUCLogLoss
from psrpc.sparse import DynamicBag, load_model

BATCH, WORKERS = 32, 2  # per worker; the cluster trains BATCH * WORKERS samples a step


def overrides(out: str, steps: int) -> list[str]:
    """The run: 1 PS, 2 workers, a small DLRM, one pass over the drifting click logs."""
    samples = steps * BATCH * WORKERS
    return [
        "model=dlrm", "model.dim=8", "model.bottom=[16,8]", "model.top=[32]",
        "data=clicks", "data.raw_ids=true", "data.distinct_ids=4000",
        "data.cardinalities=[4000,4000,4000]", "data.num_dense=4",
        f"data.num_samples={samples}", "data.test_samples=4096",
        f"data.drift={4000 / samples}",  # the catalogue's head moves 4000 items over the run
        "loss=bce", "metric=auc", "optim=adam", "optim.lr=0.003",
        "sparse.dynamic=true", "sparse.evict=lfu", "sparse.max_rows=2000", "sparse.lr=0.1",
        "cluster.num_ps=1", f"cluster.num_workers={WORKERS}", "train.device=cpu",
        "train.shuffle=false",  # the log in time order: the tables follow the drift
        f"train.steps={steps}", f"train.batch_size={BATCH}",
        f"train.log_every={max(steps // 4, 1)}", "train.untimed_steps=2", f"out_dir={out}",
    ]


def write_heldout(cfg, out_dir: Path) -> Path:
    """The test split's features and labels, as tensors: all a server of the model needs."""
    test = factories.load_data(cfg).test
    x, y = test.batch(torch.arange(len(test)))
    path = out_dir / "heldout.pt"
    torch.save({"features": x, "labels": y}, path)
    return path


def serve(cfg, out_dir: Path, batch_size: int = 512) -> dict:
    """Score DIR/heldout.pt with the model the run trained: built as the config builds it
    outside psrpc, its dense layers and tables loaded from DIR. Returns what it printed, also
    written to DIR/served.json."""
    # the dataset's factory gives the model's factory what it takes (num_dense, the tables);
    # the samples come from the held-out file
    model = factories.build_model(cfg, factories.load_data(cfg), remote_tables=False)
    load_model(model, str(out_dir), unknown="init")
    model.eval()
    held = torch.load(out_dir / "heldout.pt", weights_only=True)
    x, y = held["features"], held["labels"]
    metric = AUCLogLoss()
    with torch.no_grad():
        for start in range(0, len(y), batch_size):
            part = slice(start, start + batch_size)
            metric.update(model({k: v[part] for k, v in x.items()}), y[part])
    auc = metric.compute()["auc"]
    summary = json.loads((out_dir / "summary.json").read_text())
    print(f"held-out AUC, served without psrpc: {auc:.6f}")
    print(f"the run's test_auc:                 {summary['test_auc']:.6f} "
          f"(difference {abs(auc - summary['test_auc']):.2e})")
    print(f"the hidden model's AUC (ceiling):   {summary['hidden_auc']:.6f}")
    known = {}
    for name, bag in model.tables.bags.items():
        if not isinstance(bag, DynamicBag):
            continue
        ids = x[name].reshape(-1)
        found = torch.isin(ids, bag.ids)
        unique = torch.unique(ids)
        unique_found = int(torch.isin(unique, bag.ids).sum())
        rows = summary["tables"][name]
        known[name] = {"lookups": ids.numel(), "lookups_with_row": int(found.sum()),
                       "ids": unique.numel(), "ids_with_row": unique_found}
        print(f"  {name}: {rows['rows_live']} rows live ({rows['rows_created']} created, "
              f"{rows['rows_evicted']} evicted); of {unique.numel()} held-out ids "
              f"{unique_found} have a row, {unique.numel() - unique_found} read as their "
              f"initial value ({float(found.float().mean()):.1%} of the lookups have a row)")
    served = {"auc": auc, "test_auc": summary["test_auc"], "hidden_auc": summary["hidden_auc"],
              "tables": known}
    (out_dir / "served.json").write_text(json.dumps(served, indent=2) + "\n")
    return served


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="outputs/dynamic_tables", help="the run's output folder")
    p.add_argument("--steps", type=int, default=300, help="global training steps")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps {args.steps}: must be at least 1")
    out_dir = Path(args.out).resolve()
    config = overrides(str(out_dir), args.steps)
    summary = psrpc.train(config)
    print(f"trained {summary['steps']} steps in {summary['wall_s']:.1f} s")
    cfg = psrpc.compose(config)  # the same config, for the steps that need no cluster
    write_heldout(cfg, out_dir)
    served = serve(cfg, out_dir)
    if abs(served["auc"] - served["test_auc"]) > 1e-5:  # summary.json rounds to 6 digits
        raise SystemExit("the served AUC is not the run's test_auc")
    return served


if __name__ == "__main__":
    main()
