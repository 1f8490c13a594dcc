"""A trained run's tables read back, outside psrpc: no RPC, no parameter server.

The table shards write `out_dir/tables/ps<k>.pt` at the end of a run (each holds its rows'
global ids, "rows", and values, "weight", per table); `load_tables` joins them, `load_model`
puts them and model.pt into a model built as the config builds it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from psrpc.sparse.tables import EmbeddingTables


def load_tables(out_dir: str) -> dict[str, torch.Tensor]:
    """Every table of a run, whole ({name: (num_rows, dim)}), from the files its servers wrote
    (`out_dir/tables/ps<k>.pt`). For a table too large for one process, read the files one by
    one instead: each holds its rows' global ids ("rows") and values ("weight")."""
    files = sorted((Path(out_dir) / "tables").glob("ps*.pt"))
    if not files:
        raise FileNotFoundError(f"{out_dir}/tables/ holds no ps<k>.pt: this run had no tables")
    tables: dict[str, torch.Tensor] = {}
    for path in files:
        part = torch.load(path, weights_only=True, mmap=True)
        for name, t in part["tables"].items():
            if name not in tables:
                tables[name] = torch.empty(t["num_rows"], t["weight"].shape[1])
            tables[name][t["rows"]] = t["weight"]
    return tables


def load_model(model: torch.nn.Module, out_dir: str) -> torch.nn.Module:
    """model.pt and the tables' files of a run into `model` (built as the config builds it,
    outside psrpc: its EmbeddingTables hold their weights)."""
    state = torch.load(Path(out_dir) / "model.pt", weights_only=True)
    for name, weight in load_tables(out_dir).items():
        state[_table_key(model, name)] = weight
    model.load_state_dict(state)
    return model


def _table_key(model: torch.nn.Module, table: str) -> str:
    for prefix, module in model.named_modules():
        if isinstance(module, EmbeddingTables) and table in module.bags:
            return f"{prefix}.bags.{table}.weight" if prefix else f"bags.{table}.weight"
    raise KeyError(f"the model has no table {table!r}")
