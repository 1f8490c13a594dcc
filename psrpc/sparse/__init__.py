"""Sparse embedding tables on the parameter servers: rows and their partitioning (`rows`),
row-sparse optimizers (`optim`), the tables a model uses (`tables`: local, or remote inside
psrpc), and a run's tables read back (`export`). Pure table math: no RPC; the PS's table shard is
psrpc/ps/tables.py, a worker's client of it psrpc/worker/rows.py.

In a model: `EmbeddingTables([TableSpec("user", 10_000_000, 64), ...])`; after a run,
`load_tables(out_dir)` gives every table back, `load_model(model, out_dir)` the whole model."""

from psrpc.sparse.dynamic import DynamicTables
from psrpc.sparse.export import load_model, load_tables
from psrpc.sparse.lookup import DynamicBag
from psrpc.sparse.optim import SPARSE_OPTIMIZERS, build_sparse_optimizer
from psrpc.sparse.rows import (HashPartition, Partition, TableSpec, coalesce, hash64, hash_ids,
                               init_ids, init_rows, table_seed)
from psrpc.sparse.tables import EmbeddingTables, bag_inputs, table_options

__all__ = ["DynamicBag", "DynamicTables", "EmbeddingTables", "HashPartition", "Partition",
           "SPARSE_OPTIMIZERS", "TableSpec", "bag_inputs", "build_sparse_optimizer", "coalesce",
           "hash64", "hash_ids", "init_ids", "init_rows", "load_model", "load_tables",
           "table_options", "table_seed"]
