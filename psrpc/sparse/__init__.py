"""Sparse embedding tables for the parameter servers: rows and their partitioning (`rows`),
row-sparse optimizers (`optim`), and the local single-process tables (`tables`)."""

from psrpc.sparse.rows import (Partition, TableSpec, coalesce, hash64, hash_ids, init_rows,
                               table_seed)

__all__ = ["Partition", "TableSpec", "coalesce", "hash64", "hash_ids", "init_rows", "table_seed"]
