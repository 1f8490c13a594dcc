"""A trained run's tables read back, outside psrpc: no RPC, no parameter server.

The table shards write `out_dir/tables/ps<k>.pt` at the end of a run (each holds its rows'
global ids, "rows", and values, "weight", per table; a dynamic table its raw "ids" and their
"weight"); `load_tables` joins them, `load_model` puts them and model.pt into a model built as
the config builds it (with the run's sparse.dynamic / sparse.hash_size: `table_options`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from psrpc.sparse.lookup import DynamicBag
from psrpc.sparse.tables import EmbeddingTables


def load_tables(out_dir: str, unknown: str = "init") -> dict:
    """Every table of a run, whole, from the files its servers wrote (`out_dir/tables/
    ps<k>.pt`): {name: (num_rows, dim) tensor} for a fixed table, {name: DynamicBag} for a
    dynamic one (its rows by raw id; any other id reads as its initial value, or zeros with
    `unknown="zero"`). For a table too large for one process, read the files one by one
    instead: each holds its rows' ids ("rows", or "ids") and values ("weight")."""
    files = sorted((Path(out_dir) / "tables").glob("ps*.pt"))
    if not files:
        raise FileNotFoundError(f"{out_dir}/tables/ holds no ps<k>.pt: this run had no tables")
    tables: dict = {}
    parts: dict[str, list] = {}
    for path in files:
        part = torch.load(path, weights_only=True, mmap=True)
        for name, t in part["tables"].items():
            if t.get("dynamic"):
                parts.setdefault(name, []).append(t)
                continue
            if name not in tables:
                tables[name] = torch.empty(t["num_rows"], t["weight"].shape[1])
            tables[name][t["rows"]] = t["weight"]
    for name, ts in parts.items():
        t = ts[0]
        bag = DynamicBag(t["weight"].shape[1], t["seed"], t["init_scale"],
                         t.get("pooling", "sum"), unknown)
        tables[name] = bag.load(torch.cat([p["ids"] for p in ts]),
                                torch.cat([p["weight"] for p in ts]))
    return tables


def load_model(model: torch.nn.Module, out_dir: str, unknown: str = "init") -> torch.nn.Module:
    """model.pt and the tables' files of a run into `model` (built as the config builds it,
    outside psrpc: its EmbeddingTables hold their weights; a dynamic table's ids not in the
    run's files read as `unknown`: their initial values, or zeros)."""
    state = torch.load(Path(out_dir) / "model.pt", weights_only=True)
    for name, table in load_tables(out_dir, unknown).items():
        bags = _bags(model, name)
        if isinstance(table, DynamicBag):
            if not isinstance(bags[name], DynamicBag):
                raise ValueError(f"table {name!r} was dynamic in the run: build the model "
                                 "inside psrpc.sparse.table_options(dynamic=True) (the run's "
                                 "sparse.dynamic) or with TableSpec(dynamic=True)")
            bags[name].unknown = unknown
            bags[name].load(table.ids, table.weight)
        else:
            state[f"{_prefix(model, bags)}bags.{name}.weight"] = table
    model.load_state_dict(state)
    return model


def _bags(model: torch.nn.Module, table: str):
    for module in model.modules():
        if isinstance(module, EmbeddingTables) and table in module.bags:
            return module.bags
    raise KeyError(f"the model has no table {table!r}")


def _prefix(model: torch.nn.Module, bags) -> str:
    for prefix, module in model.named_modules():
        if isinstance(module, EmbeddingTables) and module.bags is bags:
            return f"{prefix}." if prefix else ""
    raise KeyError("table not in the model")
