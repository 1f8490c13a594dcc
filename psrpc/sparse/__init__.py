"""Sparse embedding tables for the parameter servers: rows and their partitioning (`rows`),
row-sparse optimizers (`optim`), and the local single-process tables (`tables`)."""

from psrpc.sparse.optim import SPARSE_OPTIMIZERS, build_sparse_optimizer
from psrpc.sparse.rows import (Partition, TableSpec, coalesce, hash64, hash_ids, init_rows,
                               table_seed)
from psrpc.sparse.tables import EmbeddingTables, bag_inputs

__all__ = ["EmbeddingTables", "Partition", "SPARSE_OPTIMIZERS", "TableSpec", "bag_inputs",
           "build_sparse_optimizer", "coalesce", "hash64", "hash_ids", "init_rows", "table_seed"]
