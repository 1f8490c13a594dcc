"""The baseline a click model has to beat: logistic regression on the one-hot encodings of the
same categorical features (plus the dense ones), trained in one process.

One-hot logistic regression is an `EmbeddingTables` of dim 1 (a weight per id; a multi-valued
feature pools its ids' weights like the table it stands for), a linear map of the dense features
and a bias, trained with Adagrad from zero weights in a fixed order: the same AUC every run.
"""

from __future__ import annotations

import torch
from torch import nn

from psrpc.metrics import roc_auc
from psrpc.recsys.data import batches
from psrpc.sparse.rows import TableSpec
from psrpc.sparse.tables import EmbeddingTables


class OneHotLogistic(nn.Module):
    def __init__(self, tables: list[dict], num_dense: int):
        super().__init__()
        specs = [TableSpec(t["name"], t["num_rows"], 1, pooling=t.get("pooling", "sum"),
                           hash_size=t.get("hash_size")) for t in tables]
        self.tables = EmbeddingTables(specs, sparse_grad=True)
        for bag in self.tables.bags.values():
            nn.init.zeros_(bag.weight)
        self.dense = nn.Linear(num_dense, 1) if num_dense else None
        if self.dense is not None:
            nn.init.zeros_(self.dense.weight)
            nn.init.zeros_(self.dense.bias)
        self.bias = nn.Parameter(torch.zeros(()))

    def forward(self, x: dict) -> torch.Tensor:
        logit = self.bias + sum(e.squeeze(1) for e in self.tables(x).values())
        if self.dense is not None:
            logit = logit + self.dense(x["dense"]).squeeze(1)
        return logit


def logistic_regression_auc(train, test, epochs: int = 5, lr: float = 0.2, *,
                            tables: list[dict], num_dense: int = 0, batch_size: int = 256,
                            seed: int = 0) -> float:
    """Train one-hot logistic regression on `train` for `epochs` (shuffled by `seed`, Adagrad at
    `lr`, BCE) and return its ROC AUC on `test`. `tables` and `num_dense` as the dataset factory
    gives them. The defaults are the best of a sweep on MovieLens 100K (lr 0.02-0.5, 1-8 epochs:
    AUC 0.693 here, 0.695 at most)."""
    threads = torch.get_num_threads()
    # tiny ops: a second intra-op thread only adds synchronisation (0.9 s an epoch on one
    # thread, 4 s on two when the other core is busy)
    torch.set_num_threads(1)
    try:
        return _train_and_evaluate(train, test, epochs, lr, tables, num_dense, batch_size, seed)
    finally:
        torch.set_num_threads(threads)


def _train_and_evaluate(train, test, epochs, lr, tables, num_dense, batch_size, seed) -> float:
    model = OneHotLogistic(tables, num_dense)
    optimizer = torch.optim.Adagrad(model.parameters(), lr=lr)
    loss_fn = nn.BCEWithLogitsLoss()
    generator = torch.Generator().manual_seed(seed)
    # torch's Adagrad builds sparse tensors from valid indices: no invariant checks (and no
    # warning that they are off)
    with torch.sparse.check_sparse_tensor_invariants(enable=False):
        for _ in range(epochs):
            for x, y in batches(train, batch_size, shuffle=True, generator=generator):
                optimizer.zero_grad(set_to_none=True)
                loss_fn(model(x), y).backward()
                optimizer.step()
    return evaluate_auc(model, test)


@torch.no_grad()
def evaluate_auc(model: nn.Module, dataset, batch_size: int = 4096) -> float:
    """ROC AUC of `model`'s logits on `dataset`."""
    was_training = model.training
    model.eval()
    logits, labels = [], []
    for x, y in batches(dataset, batch_size):
        logits.append(model(x).reshape(-1))
        labels.append(y.reshape(-1))
    model.train(was_training)
    return roc_auc(torch.cat(logits), torch.cat(labels))
