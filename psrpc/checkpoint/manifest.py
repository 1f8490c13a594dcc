"""What a well-formed checkpoint looks like, checked before anything of it is restored.

A manifest or shard file comes from disk: an older version, a crash, a hand edit or another
program may have left anything there. Each check returns what is wrong (None: nothing), so that
`checkpoint.find_latest` can skip the step with a warning naming the file instead of failing
somewhere deep in the restore with a KeyError.

    manifest.json  {"format", "step", "num_shards", "layout", "files": [entry per shard],
                    "buffers": entry (optional: older checkpoints have none),
                    "tables": {"specs": [{name, num_rows, dim}], "partition", "num_ps",
                               "files": [entry per PS]} (only with embedding tables), ...}
    entry          {"file": "shard-K.pt" | "buffers.pt" | "tables-K.pt", "bytes": int >= 0,
                    "sha256": 64 hex}
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path
from typing import Any, Optional

import torch

from psrpc.cluster.layout import Layout

FORMAT = "psrpc-checkpoint-1"
REQUIRED = ("format", "step", "num_shards", "layout", "files")
_SHA256 = re.compile(r"[0-9a-f]{64}$")


def shard_file(k: int) -> str:
    return f"shard-{k}.pt"


BUFFERS_FILE = "buffers.pt"


def _is_int(x: Any, low: int = 0) -> bool:
    return type(x) is int and x >= low  # bool is an int subclass: not a count


def entry_problem(entry: Any, expected_name: str) -> Optional[str]:
    """A file entry: a bare file name (never a path: `../x`, `/etc/x`, `a/b` would read files
    outside the step's folder), its size and its sha256."""
    if not isinstance(entry, dict):
        return f"an entry is {type(entry).__name__}, expected an object"
    for key in ("file", "bytes", "sha256"):
        if key not in entry:
            return f"an entry has no {key!r}"
    name = entry["file"]
    if not isinstance(name, str) or name != expected_name:
        return f"file {name!r}, expected {expected_name!r}"
    if not _is_int(entry["bytes"]):
        return f"{name}: bytes {entry['bytes']!r}, expected an integer >= 0"
    if not isinstance(entry["sha256"], str) or not _SHA256.match(entry["sha256"]):
        return f"{name}: sha256 {entry['sha256']!r}, expected 64 hex digits"
    return None


def manifest_problem(m: Any, step: int) -> tuple[Optional[str], Optional[Layout]]:
    """(what is wrong, None) or (None, the layout) for a parsed manifest of folder step-`step`."""
    if not isinstance(m, dict):
        return f"holds {type(m).__name__}, expected an object", None
    missing = [k for k in REQUIRED if k not in m]
    if missing:
        return f"missing key {missing[0]!r}", None
    if m["format"] != FORMAT:
        return f"format {m['format']!r}, expected {FORMAT!r}", None
    if not _is_int(m["step"]) or m["step"] != step:
        return f"step {m['step']!r} but the folder is step-{step}", None
    n = m["num_shards"]
    if not _is_int(n, 1):
        return f"num_shards {n!r}, expected an integer >= 1", None
    files = m["files"]
    if not isinstance(files, list) or len(files) != n:
        got = f"{len(files)} entries" if isinstance(files, list) else type(files).__name__
        return f"files has {got}, expected a list of num_shards={n}", None
    for k, entry in enumerate(files):
        problem = entry_problem(entry, shard_file(k))
        if problem:
            return f"files[{k}]: {problem}", None
    if "buffers" in m:
        problem = entry_problem(m["buffers"], BUFFERS_FILE)
        if problem:
            return f"buffers: {problem}", None
    if "tables" in m:
        problem = tables_problem(m["tables"])
        if problem:
            return f"tables: {problem}", None
    try:
        layout = Layout.from_dict(m["layout"])
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        return f"layout is unreadable ({type(e).__name__}: {e})", None
    problem = layout_problem(layout)
    if problem is None and layout.num_shards != n:
        problem = f"{layout.num_shards} shards, num_shards says {n}"
    return (f"layout: {problem}", None) if problem else (None, layout)


def tables_problem(t: Any) -> Optional[str]:
    """The embedding tables' part: their specs, their partition and one file per PS."""
    if not isinstance(t, dict) or not {"specs", "partition", "num_ps", "files"} <= set(t):
        return "expected an object with specs, partition, num_ps and files"
    if t["partition"] not in ("mod", "div") or not _is_int(t["num_ps"], 1):
        return f"partition {t['partition']!r} over num_ps {t['num_ps']!r}"
    specs = t["specs"]
    if not isinstance(specs, list) or not specs or not all(
            isinstance(s, dict) and set(s) == {"name", "num_rows", "dim"}
            and isinstance(s["name"], str) and _is_int(s["num_rows"], 1) and _is_int(s["dim"], 1)
            for s in specs):
        return "specs must be a list of {name, num_rows, dim}"
    files = t["files"]
    if not isinstance(files, list) or len(files) != t["num_ps"]:
        return f"files must be a list of num_ps={t['num_ps']} entries"
    for k, entry in enumerate(files):
        problem = entry_problem(entry, f"tables-{k}.pt")
        if problem:
            return f"files[{k}]: {problem}"
    return None


def layout_problem(layout: Layout) -> Optional[str]:
    """Every piece inside its tensor and its shard, every element of a tensor covered once,
    no two pieces overlapping (so that join and split cannot fail on it)."""
    return (_shapes_problem(layout) or _pieces_problem(layout) or _coverage_problem(layout)
            or _overlap_problem(layout))


def _shapes_problem(layout: Layout) -> Optional[str]:
    for name, shape in layout.shapes.items():
        if not isinstance(name, str) or not all(_is_int(d) for d in shape):
            return f"tensor {name!r} has shape {shape!r}"
    if not all(_is_int(x) for x in layout.shard_numel + layout.shard_ps) \
            or len(layout.shard_ps) != len(layout.shard_numel):
        return "shard_numel/shard_ps are not lists of integers >= 0 of the same length"
    return None


def _pieces_problem(layout: Layout) -> Optional[str]:
    for p in layout.pieces:
        if p.name not in layout.shapes:
            return f"a piece names unknown tensor {p.name!r}"
        shape = layout.shapes[p.name]
        rows = shape[0] if shape else 1
        ints = all(_is_int(x) for x in (p.row_start, p.row_end, p.shard, p.offset, p.numel))
        if not ints or not p.row_start < p.row_end <= rows or p.shard >= layout.num_shards \
                or p.numel != (p.row_end - p.row_start) * math.prod(shape[1:]) \
                or p.offset + p.numel > layout.shard_numel[p.shard]:
            return f"piece {p} does not fit its tensor {shape} or its shard"
    return None


def _coverage_problem(layout: Layout) -> Optional[str]:
    covered = {name: 0 for name in layout.shapes}
    for p in layout.pieces:
        covered[p.name] += p.numel
    for name, shape in layout.shapes.items():
        if covered[name] != math.prod(shape):
            return f"the pieces of {name!r} cover {covered[name]} of {math.prod(shape)} elements"
    return None


def _overlap_problem(layout: Layout) -> Optional[str]:
    for k in range(layout.num_shards):  # pieces never overlap (alignment leaves gaps)
        spans = sorted((p.offset, p.offset + p.numel) for p in layout.pieces if p.shard == k)
        if any(a[1] > b[0] for a, b in zip(spans, spans[1:])):
            return f"pieces overlap in shard {k}"
    return None


def shard_state_problem(state: Any, k: int, step: int, numel: int,
                        optim_keys: Optional[set] = None) -> Optional[str]:
    """A loaded shard file: shard k of step `step`, `numel` float32 parameters, optimizer
    state for its one tensor (per-element tensors of the same length; the same keys on every
    shard: `optim_keys`, shard 0's)."""
    if not isinstance(state, dict):
        return f"holds {type(state).__name__}, expected a dict"
    return (_shard_header_problem(state, k, step) or _params_problem(state["params"], numel)
            or _optimizer_problem(state["optimizer"], numel, optim_keys)
            or _stats_problem(state.get("stats", {})))


def _shard_header_problem(state: dict, k: int, step: int) -> Optional[str]:
    for key in ("format", "shard", "version", "params", "optimizer"):
        if key not in state:
            return f"missing key {key!r}"
    if state["format"] != FORMAT or state["shard"] != k or state["version"] != step:
        return (f"format/shard/version {state['format']!r}/{state['shard']!r}/"
                f"{state['version']!r}, the manifest says {FORMAT!r}/{k}/{step}")
    return None


def _params_problem(params: Any, numel: int) -> Optional[str]:
    if not torch.is_tensor(params) or params.dtype != torch.float32 or params.dim() != 1 \
            or params.numel() != numel:
        return f"params are not {numel} float32 elements (the manifest's layout)"
    return None


def _optimizer_problem(optim: Any, numel: int, optim_keys: Optional[set]) -> Optional[str]:
    per_param = optim.get("state") if isinstance(optim, dict) else None
    if not isinstance(per_param, dict) or not set(per_param) <= {0} \
            or not all(isinstance(v, dict) for v in per_param.values()):
        return "optimizer state is not {'state': {0: {...}}} (one flat tensor)"
    values = per_param.get(0, {})
    if optim_keys is not None and set(values) != optim_keys:
        return f"optimizer state keys {sorted(values)}, shard 0 has {sorted(optim_keys)}"
    for key, value in values.items():
        if torch.is_tensor(value) and value.dim() >= 1 and value.shape != (numel,):
            return f"optimizer state {key!r} has shape {tuple(value.shape)}, expected ({numel},)"
    return None


def _stats_problem(stats: Any) -> Optional[str]:
    if not isinstance(stats, dict) or not all(
            type(v) in (int, float) or isinstance(v, dict) for v in stats.values()):
        return "stats is not a dict of counters"
    return None


def buffers_problem(saved: Any, step: int) -> Optional[str]:
    """A loaded buffers.pt: {"format", "step", "buffers": {name: tensor}}."""
    if not isinstance(saved, dict) or saved.get("format") != FORMAT or saved.get("step") != step:
        return f"not the buffers of step {step} in format {FORMAT!r}"
    buffers = saved.get("buffers")
    if not isinstance(buffers, dict) or not all(
            isinstance(n, str) and torch.is_tensor(b) for n, b in buffers.items()):
        return "buffers is not a dict of named tensors"
    return None

# -- a checkpoint folder on disk ------------------------------------------------------------------
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"step-(0|[1-9]\d*)$")  # step-N exactly as step_dir names it


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step-{step}"


def steps_on_disk(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) for every step-N folder, newest first."""
    if not Path(root).is_dir():
        return []
    found = [(int(m.group(1)), p) for p in Path(root).iterdir()
             if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return sorted(found, reverse=True)


def file_digest(path: Path) -> dict:
    """{"bytes", "sha256"} of a file, read in chunks (a table shard's file can be GBs)."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
            size += len(chunk)
    return {"bytes": size, "sha256": digest.hexdigest()}


def file_problem(path: Path, entry: dict) -> Optional[str]:
    """A file of a step against its manifest entry (size and sha256); None when it matches."""
    try:
        got = file_digest(path)
    except OSError as e:
        return f"{path} is unreadable ({e.strerror})"
    if got["bytes"] != entry["bytes"] or got["sha256"] != entry["sha256"]:
        return (f"{path} is truncated or corrupt ({got['bytes']} bytes, manifest says "
                f"{entry['bytes']})")
    return None


def step_problem(step: int, folder: Path) -> Optional[str]:
    """What stops committed step `folder` from loading, read without loading it: the manifest
    parses and is well formed, and every file it lists is there with its size and sha256;
    None when it checks out."""
    path = folder / MANIFEST
    try:
        m = json.loads(path.read_bytes())
    except (OSError, ValueError) as e:
        return f"{path} is unreadable ({e})"
    problem, _ = manifest_problem(m, step)
    if problem:
        return f"{path} is malformed: {problem}"
    entries = list(m["files"]) + ([m["buffers"]] if "buffers" in m else [])
    entries += list(m["tables"]["files"]) if "tables" in m else []
    for entry in entries:
        problem = file_problem(folder / entry["file"], entry)
        if problem:
            return problem
    return None
