"""One process, no RPC: the local DLRM on MovieLens 100K against the one-hot logistic regression
baseline, both on the same time split, with the test AUC after every epoch.

The tables train as they will on the parameter servers: sparse row gradients, coalesced, stepped
by a row-sparse optimizer (`psrpc.sparse.optim`); the MLPs with torch's Adam.

    python -m benchmarks.dlrm_movielens --root ../shared/data/ml-100k
    python -m benchmarks.dlrm_movielens --seed 1 --table-optim adam --table-lr 0.001 --table-wd 0

Defaults: the best of a small sweep (dim 8/16/32, table lr 0.01-0.1, table weight decay 0-0.1,
MLP lr 3e-4-3e-3, batch 256/1024, top MLP 64-32/128-64, Adagrad/Adam/SGD for the tables).
On 2 cores: logistic regression 0.693, DLRM 0.704-0.708 after 4 epochs over seeds 0-2.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from torch import nn

from psrpc.recsys.data import batches, movielens
from psrpc.recsys.dlrm import DLRM, make_dlrm
from psrpc.recsys.reference import evaluate_auc, logistic_regression_auc
from psrpc.sparse.optim import build_sparse_optimizer
from psrpc.sparse.tables import EmbeddingTables


def train_dlrm(data: dict, args) -> list[float]:
    """Test AUC after each epoch."""
    local = make_dlrm(data["num_dense"], data["tables"], bottom=args.bottom, top=args.top,
                      dim=args.dim, seed=args.seed)
    # the same model with tables that produce sparse gradients, as the PS tables will
    model = DLRM(data["num_dense"], local.specs, args.bottom, args.top, seed=args.seed,
                 tables=EmbeddingTables(local.specs, seed=args.seed, sparse_grad=True))
    table_params = {n: b.weight for n, b in model.tables.bags.items()}
    dense_params = [p for n, p in model.named_parameters() if not n.startswith("tables.")]
    dense_opt = torch.optim.Adam(dense_params, lr=args.dense_lr)
    hyper = {"weight_decay": args.table_wd} if args.table_wd else {}
    table_opts = {n: build_sparse_optimizer(args.table_optim, w.data, **hyper)
                  for n, w in table_params.items()}
    loss_fn = nn.BCEWithLogitsLoss()
    generator = torch.Generator().manual_seed(args.seed)
    aucs = []
    for _ in range(args.epochs):
        for x, y in batches(data["train"], args.batch_size, shuffle=True, generator=generator):
            dense_opt.zero_grad(set_to_none=True)
            for w in table_params.values():
                w.grad = None
            loss_fn(model(x), y).backward()
            dense_opt.step()
            for n, w in table_params.items():
                grad = w.grad.coalesce()  # unique rows, ascending
                table_opts[n].step(grad.indices()[0], grad.values(), args.table_lr)
        aucs.append(evaluate_auc(model, data["test"]))
    return aucs


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", default="../shared/data/ml-100k")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--bottom", type=int, nargs="+", default=[64, 16])
    p.add_argument("--top", type=int, nargs="+", default=[64, 32])
    p.add_argument("--dense-lr", type=float, default=1e-3)
    p.add_argument("--table-optim", default="adagrad")
    p.add_argument("--table-lr", type=float, default=0.05)
    p.add_argument("--table-wd", type=float, default=1e-3)
    p.add_argument("--lr-epochs", type=int, default=5)
    p.add_argument("--lr-lr", type=float, default=0.2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--skip-reference", action="store_true")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"command: python -m benchmarks.dlrm_movielens {' '.join(argv)}".rstrip())
    data = movielens(args.root)
    if not args.skip_reference:
        t0, c0 = time.perf_counter(), time.process_time()
        auc = logistic_regression_auc(data["train"], data["test"], args.lr_epochs, args.lr_lr,
                                      tables=data["tables"], num_dense=data["num_dense"],
                                      seed=args.seed)
        print(f"logistic regression: {args.lr_epochs} epochs, Adagrad lr {args.lr_lr}: "
              f"test AUC {auc:.4f} ({time.perf_counter() - t0:.1f} s wall, "
              f"{time.process_time() - c0:.1f} s CPU)")
    t0, c0 = time.perf_counter(), time.process_time()
    aucs = train_dlrm(data, args)
    print(f"DLRM dim {args.dim} bottom {args.bottom} top {args.top}, batch {args.batch_size}, "
          f"Adam {args.dense_lr} + row-sparse {args.table_optim} {args.table_lr} (weight decay "
          f"{args.table_wd}): test AUC per "
          f"epoch {' '.join(f'{a:.4f}' for a in aucs)} ({time.perf_counter() - t0:.1f} s wall, "
          f"{time.process_time() - c0:.1f} s CPU)")


if __name__ == "__main__":
    main()
