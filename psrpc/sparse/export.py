"""A trained run's tables read back, outside psrpc: no RPC, no parameter server.

At the end of a run every table shard writes `out_dir/tables/ps<k>.pt` (each holds its rows'
global ids, "rows", and values, "weight", per table; a dynamic table its raw "ids" and their
"weight"), tagged with the export's id, its step and the number of servers. Once every server has
written its file, the chief writes `tables/index.json`, naming the files of that export. The chief
removes the index before it writes model.pt and the files an earlier export left in the folder
before it asks the servers to write theirs, so an index always belongs to the model.pt beside it.

`load_tables` reads exactly the files the index names and checks that they are that export's and
that every row is held once (a fixed table: each row 0..num_rows-1 in exactly one file; a dynamic
table: no id in two files, each id in its server's file); anything else raises
TablesExportError naming the file and what was expected. `load_model` puts the tables and
model.pt into a model built as the config builds it (with the run's sparse.dynamic /
sparse.hash_size: `table_options`).

A folder written before the index existed (no index.json, files without an export id) is read
only when its files are one whole export by themselves: ps0.pt..ps<P-1>.pt, each of P servers
and the same step, every row held once.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from psrpc.errors import PsrpcError, TablesExportError
from psrpc.sparse.lookup import DynamicBag
from psrpc.sparse.rows import HashPartition
from psrpc.sparse.tables import EmbeddingTables

TABLES_FORMAT = "psrpc-tables-1"  # a PS's ps<k>.pt
INDEX = "index.json"
INDEX_FORMAT = "psrpc-tables-index-1"
_FILE = re.compile(r"ps(\d+)\.pt")
_AGAIN = ("run it again to export its tables anew (a run writes tables/index.json, naming its "
          "files, once every PS has written its own)")


def table_file(ps: int) -> str:
    return f"ps{ps}.pt"


def table_files(folder: Path) -> list[Path]:
    """The ps<k>.pt files in a tables/ folder, by k."""
    found = [(int(m.group(1)), p) for p in folder.glob("ps*.pt") if (m := _FILE.fullmatch(p.name))]
    return [p for _, p in sorted(found)]


def make_index(export_id: str, num_ps: int, written: list[dict]) -> dict:
    """index.json of one export, from what each PS says it wrote (TableShard.export's return:
    its file, ps, num_ps, version, partition and tables); a PsrpcError unless they are one
    export: every PS 0..num_ps-1 once, at the same step, with the same tables."""
    by_ps = {w["ps"]: w for w in written}
    if sorted(by_ps) != list(range(num_ps)) or len(written) != num_ps:
        raise PsrpcError(f"the table export expected a file from each of ps0..ps{num_ps - 1}, "
                         f"got {sorted(w['ps'] for w in written)}")
    first = by_ps[0]
    for w in written:
        if (w["version"], w["num_ps"], w["partition"], w["tables"]) != \
                (first["version"], num_ps, first["partition"], first["tables"]):
            raise PsrpcError(f"the table export: ps{w['ps']} wrote step {w['version']} of "
                             f"{w['num_ps']} servers, tables {sorted(w['tables'])}; ps0 step "
                             f"{first['version']} of {num_ps}, tables {sorted(first['tables'])}")
    return {"format": INDEX_FORMAT, "export": export_id, "num_ps": num_ps,
            "version": first["version"], "partition": first["partition"],
            "files": [by_ps[k]["file"] for k in range(num_ps)], "tables": first["tables"]}


def tables_meta(tables: dict) -> dict:
    """{name: {"dynamic", "num_rows", "dim"}} of a ps<k>.pt's tables."""
    return {n: {"dynamic": bool(t.get("dynamic")), "num_rows": int(t["num_rows"]),
                "dim": int(t["weight"].shape[1])} for n, t in tables.items()}


def load_tables(out_dir: str, unknown: str = "init") -> dict:
    """Every table of a run, whole, from the files of its export (`out_dir/tables/index.json`
    and the ps<k>.pt it names): {name: (num_rows, dim) tensor} for a fixed table, {name:
    DynamicBag} for a dynamic one (its rows by raw id; any other id reads as its initial value,
    or zeros with `unknown="zero"`). TablesExportError when a file is missing, is not that
    export's, or a row is missing or held twice. For a table too large for one process, read
    the files index.json names one by one instead: each holds its rows' ids ("rows", or "ids")
    and values ("weight")."""
    folder = Path(out_dir) / "tables"
    index, parts = _read_export(folder)
    tables: dict = {}
    for name, meta in index["tables"].items():
        mine = [(k, path, part["tables"][name]) for k, (path, part) in enumerate(parts)]
        tables[name] = (_dynamic(name, meta, mine, index["num_ps"], unknown) if meta["dynamic"]
                        else _fixed(name, meta, mine))
    return tables


def load_model(model: torch.nn.Module, out_dir: str, unknown: str = "init") -> torch.nn.Module:
    """model.pt and the tables' files of a run into `model` (built as the config builds it,
    outside psrpc: its EmbeddingTables hold their weights; a dynamic table's ids not in the
    run's files read as `unknown`: their initial values, or zeros). The tables are checked as
    `load_tables` checks them."""
    tables = load_tables(out_dir, unknown)
    state = torch.load(Path(out_dir) / "model.pt", weights_only=True)
    for name, table in tables.items():
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


# -- which files, and are they one export ---------------------------------------------------------
def _read_export(folder: Path) -> tuple[dict, list]:
    """(the index, [(path, contents) of each file it names, by ps]), each file checked against
    the index; a folder without an index: _legacy."""
    if not (folder / INDEX).is_file():
        return _legacy(folder)
    try:
        index = json.loads((folder / INDEX).read_text())
    except ValueError as e:
        raise TablesExportError(f"{folder / INDEX} is not valid JSON ({e}): {_AGAIN}") from None
    if not isinstance(index, dict) or index.get("format") != INDEX_FORMAT:
        raise TablesExportError(f"{folder / INDEX} is not a psrpc tables index (format "
                                f"{INDEX_FORMAT!r}): {_AGAIN}")
    parts = []
    for k, name in enumerate(index["files"]):
        path = folder / name
        if not path.is_file():
            raise TablesExportError(
                f"{path} is missing: {INDEX} names {', '.join(index['files'])} ({_which(index)})."
                " Each PS writes its file into the out_dir of its own host: without shared "
                f"storage, copy every PS's tables/{name} into {folder}")
        part = torch.load(path, weights_only=True, mmap=True)
        _check_part(path, part, k, index)
        parts.append((path, part))
    return index, parts


def _which(index: dict) -> str:
    what = f"export {index['export']}, " if index.get("export") else ""
    return f"{what}step {index['version']}, num_ps={index['num_ps']}"


def _check_part(path: Path, part, k: int, index: dict) -> None:
    """A TablesExportError unless `part` is file k of the export `index` describes."""
    if not isinstance(part, dict) or part.get("format") != TABLES_FORMAT:
        raise TablesExportError(f"{path} is not a psrpc table file (format {TABLES_FORMAT!r})")
    theirs = {"export": part.get("export"), "ps": part.get("ps", k), "num_ps": part["num_ps"],
              "version": part["version"], "partition": part["partition"]}
    ours = {"export": index.get("export"), "ps": k, "num_ps": index["num_ps"],
            "version": index["version"], "partition": index["partition"]}
    wrong = [f"{key} {theirs[key]!r}, expected {ours[key]!r}" for key in ours
             if theirs[key] != ours[key]]
    if wrong:
        raise TablesExportError(f"{path} is not part of the export {INDEX} names ({_which(index)})"
                                f": it holds {'; '.join(wrong)}. A file left by another run; "
                                f"{_AGAIN}")
    if sorted(part["tables"]) != sorted(index["tables"]):
        raise TablesExportError(f"{path} holds tables {sorted(part['tables'])}; the export has "
                                f"{sorted(index['tables'])}")


def _legacy(folder: Path) -> tuple[dict, list]:
    """A folder without index.json (written before psrpc wrote one): its ps<k>.pt, read only
    when they are one whole export by themselves."""
    files = table_files(folder)
    if not files:
        raise FileNotFoundError(f"{folder}/ holds no {INDEX} and no ps<k>.pt: this run had no "
                                "tables")
    parts = [(p, torch.load(p, weights_only=True, mmap=True)) for p in files]
    if any(isinstance(part, dict) and "export" in part for _, part in parts):
        raise TablesExportError(f"{folder} holds no {INDEX}, which an export writes last, once "
                                "every PS has written its file: the export did not finish, or "
                                f"{INDEX} was not copied with the files; {_AGAIN}")
    seen = {p.name: (part.get("num_ps"), part.get("version")) if isinstance(part, dict) else None
            for p, part in parts}
    first = parts[0][1] if isinstance(parts[0][1], dict) else {}
    num_ps, version = first.get("num_ps"), first.get("version")
    expected = [table_file(k) for k in range(num_ps)] if isinstance(num_ps, int) else []
    if [p.name for p in files] != expected or len(set(seen.values())) != 1:
        found = ", ".join(f"{n} (num_ps={s[0]}, step {s[1]})" if s else n
                          for n, s in seen.items())
        raise TablesExportError(
            f"{folder} holds no {INDEX} (an export by an older psrpc), and its files are not one "
            f"export: {found}; one export of P servers is ps0.pt..ps<P-1>.pt, each saying "
            f"num_ps=P and the same step. {_AGAIN[0].upper()}{_AGAIN[1:]}")
    index = {"export": None, "num_ps": num_ps, "version": version,
             "partition": first.get("partition"), "files": expected,
             "tables": tables_meta(first["tables"])}
    for k, (path, part) in enumerate(parts):
        _check_part(path, part, k, index)
    return index, parts


# -- is every row held once -----------------------------------------------------------------------
def _fixed(name: str, meta: dict, mine: list) -> torch.Tensor:
    n, dim = meta["num_rows"], meta["dim"]
    table = torch.empty(n, dim)
    count = torch.zeros(n, dtype=torch.int32)
    for _, path, t in mine:
        rows, weight = t["rows"], t["weight"]
        if t.get("dynamic") or t["num_rows"] != n or rows.dtype != torch.int64 \
                or rows.dim() != 1 or weight.shape != (rows.numel(), dim) \
                or (rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= n)):
            raise TablesExportError(f"{path}: table {name!r} holds rows {tuple(rows.shape)} and "
                                    f"values {tuple(weight.shape)}; expected int64 rows in "
                                    f"[0, {n}) and ({rows.numel()}, {dim}) values")
        table[rows] = weight
        count.index_add_(0, rows, torch.ones(rows.numel(), dtype=torch.int32))
    if bool((count != 1).any()):
        missing = (count == 0).nonzero().flatten()
        twice = (count > 1).nonzero().flatten()
        problems = []
        if missing.numel():
            problems.append(f"{missing.numel()} rows in no file (rows {_few(missing)})")
        if twice.numel():
            holders = [p.name for _, p, t in mine if bool((t["rows"] == twice[0]).any())]
            problems.append(f"{twice.numel()} rows in more than one file (rows {_few(twice)}; row "
                            f"{int(twice[0])} in {', '.join(holders)})")
        raise TablesExportError(f"table {name!r}: every row 0..{n - 1} must be in exactly one "
                                f"file of {', '.join(p.name for _, p, _ in mine)}; "
                                f"{' and '.join(problems)}")
    return table


def _dynamic(name: str, meta: dict, mine: list, num_ps: int, unknown: str) -> DynamicBag:
    first = mine[0][2]
    dim = meta["dim"]
    for _, path, t in mine:
        ids, weight = t["ids"], t["weight"]
        if not t.get("dynamic") or ids.dtype != torch.int64 or ids.dim() != 1 \
                or weight.shape != (ids.numel(), dim) \
                or (t["seed"], t["init_scale"], t.get("pooling", "sum")) \
                != (first["seed"], first["init_scale"], first.get("pooling", "sum")):
            raise TablesExportError(f"{path}: dynamic table {name!r} holds ids "
                                    f"{tuple(ids.shape)} and values {tuple(weight.shape)} (seed "
                                    f"{t.get('seed')}); expected int64 ids, ({ids.numel()}, "
                                    f"{dim}) values and the seed of {mine[0][1].name}")
    ids = torch.cat([t["ids"] for _, _, t in mine])
    unique, counts = torch.unique(ids, return_counts=True)
    if unique.numel() != ids.numel():
        twice = unique[counts > 1]
        holders = [p.name for _, p, t in mine if bool((t["ids"] == twice[0]).any())]
        raise TablesExportError(f"dynamic table {name!r}: {twice.numel()} ids are held more than "
                                f"once (ids {_few(twice)}; id {int(twice[0])} in "
                                f"{', '.join(holders)}): each id has one row, on one server")
    servers = HashPartition(num_ps)
    for k, path, t in mine:
        if t["ids"].numel():
            owner = torch.from_numpy(servers.servers(t["ids"].numpy()))
            stray = t["ids"][owner != k]
            if stray.numel():
                raise TablesExportError(f"{path}: dynamic table {name!r} holds {stray.numel()} "
                                        f"ids ({_few(stray)}) that ps{k} of {num_ps} does not "
                                        "own (an id is on server hash(id) % num_ps): a file of "
                                        f"another run; {_AGAIN}")
    bag = DynamicBag(dim, first["seed"], first["init_scale"], first.get("pooling", "sum"),
                     unknown)
    return bag.load(ids, torch.cat([t["weight"] for _, _, t in mine]))


def _few(ids: torch.Tensor, n: int = 5) -> str:
    """The first n of some ids or rows, for a message."""
    return ", ".join(str(int(i)) for i in ids[:n]) + (", ..." if ids.numel() > n else "")


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
