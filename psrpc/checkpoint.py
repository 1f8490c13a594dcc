"""Checkpoints: one file per shard, written by its PS, and a manifest written last by the chief.

    checkpoint.dir/step-N/shard-K.pt      {"format", "shard", "version", "params", "optimizer",
                                           "stats"}
    checkpoint.dir/step-N/buffers.pt      {"format", "step", "buffers"}: the chief's replica's
                                          buffers (BatchNorm statistics) at step N
    checkpoint.dir/step-N/manifest.json   the commit point: step, layout, every file's size/sha256

Files go to a temporary name, then are renamed, and the folder is synced; a step folder that
holds a manifest is never written to again. Restore takes the newest step whose manifest and
files all check out (a truncated, unreadable, malformed or uncommitted step is skipped with a
warning naming the file; psrpc/manifest.py says what is checked), loads with weights_only=True,
and re-splits for any number of PS: parameters and the optimizer's per-element state are joined
by the saved layout and split by the new one. The buffers go back into every replica.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from psrpc.errors import PsrpcError
from psrpc.cluster.layout import Layout
from psrpc.manifest import (BUFFERS_FILE, FORMAT, buffers_problem, manifest_problem, shard_file,
                            shard_state_problem)

log = logging.getLogger("psrpc")
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"step-(0|[1-9]\d*)$")  # step-N exactly as step_dir names it


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step-{step}"


def _fsync_dir(folder: Path) -> None:
    """A rename or a new entry survives a power cut only once its directory is synced too
    (POSIX: fsync on a file covers its data, not the directory entry pointing at it)."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _make_dirs(folder: Path) -> None:
    """mkdir -p, each new folder made durable in its parent."""
    missing = []
    while not folder.exists():
        missing.append(folder)
        folder = folder.parent
    for new in reversed(missing):
        try:
            new.mkdir()
        except FileExistsError:  # another PS made it first
            continue
        _fsync_dir(new.parent)


def write_atomic(path: Path, data, exclusive: bool = False) -> None:
    """Write to a temporary name, then rename. `data`: bytes, or a dict that torch.save writes
    straight into the file (no in-memory copy of a large table). `exclusive`: fail with
    FileExistsError rather than replace an existing file (a hard link is an atomic
    create-if-absent)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        if isinstance(data, (bytes, bytearray)):
            f.write(data)
        else:
            torch.save(data, f)
        f.flush()
        os.fsync(f.fileno())
    try:
        if not exclusive:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)
            except FileExistsError:
                raise
            except OSError:  # a file system without hard links: check, then rename
                if path.exists():
                    raise FileExistsError(path) from None
                os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(path.parent)


class StepCommitted(PsrpcError):
    """A save into a step folder that already holds a manifest: committed steps are never
    overwritten (rewriting one in place could leave it half old, half new after a crash)."""


def is_committed(root, step: int) -> bool:
    return (step_dir(root, step) / MANIFEST).exists()


def _refuse_committed(folder: Path) -> None:
    if (folder / MANIFEST).exists():
        raise StepCommitted(f"{folder} already holds a committed checkpoint ({MANIFEST}, "
                            "perhaps from an earlier run); committed steps are never overwritten")


# -- PS side ---------------------------------------------------------------------------------
def save_shard(root: Path, state: dict) -> dict:
    """Write one shard's state (already a snapshot); returns what the manifest records.
    Raises StepCommitted if the step's folder is already committed."""
    name = state.pop("file", None) or shard_file(state["shard"])  # a table shard names its own
    return _save(root, state["version"], name, {"format": FORMAT, **state})


def _save(root: Path, step: int, name: str, obj: dict) -> dict:
    """torch.save `obj` as step-`step`/`name`; returns its manifest entry."""
    folder = step_dir(root, step)
    _refuse_committed(folder)
    _make_dirs(folder)
    write_atomic(folder / name, obj)
    return {"file": name, **file_digest(folder / name)}


def file_digest(path: Path) -> dict:
    """{"bytes", "sha256"} of a file, read in chunks (a table shard's file can be GBs)."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
            size += len(chunk)
    return {"bytes": size, "sha256": digest.hexdigest()}


# -- chief side ------------------------------------------------------------------------------
def save_buffers(root: Path, step: int, buffers: dict[str, torch.Tensor]) -> dict:
    """The chief's replica's buffers (BatchNorm statistics) at step `step`: model state that
    is not a parameter, so no shard holds it. Written before the manifest, which lists it."""
    return _save(root, step, BUFFERS_FILE, {"format": FORMAT, "step": step, "buffers": buffers})


def write_manifest(root: Path, step: int, layout: Layout, files: list[dict], extra: dict,
                   buffers: Optional[dict] = None, tables: Optional[dict] = None) -> None:
    """The commit point: written last, once every file it lists is on disk. `buffers`: the
    entry save_buffers returned; `tables`: the embedding tables' specs, partition and files."""
    manifest = {"format": FORMAT, "step": step, "num_shards": layout.num_shards,
                "layout": layout.to_dict(), "files": files, **extra}
    if buffers is not None:
        manifest["buffers"] = buffers
    if tables is not None:
        manifest["tables"] = tables
    folder = step_dir(root, step)
    try:
        write_atomic(folder / MANIFEST, json.dumps(manifest, indent=1).encode(), exclusive=True)
    except FileExistsError:
        _refuse_committed(folder)
        raise


def steps_on_disk(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) for every step-N folder, newest first."""
    if not Path(root).is_dir():
        return []
    found = [(int(m.group(1)), p) for p in Path(root).iterdir()
             if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return sorted(found, reverse=True)


def prune(root: Path, keep: int, committed: int) -> None:
    """Keep the newest `keep` committed checkpoints; drop uncommitted ones older than `committed`."""
    kept = 0
    for step, folder in steps_on_disk(root):
        complete = (folder / MANIFEST).exists()
        if complete and kept < keep:
            kept += 1
            continue
        if complete or step < committed:
            shutil.rmtree(folder, ignore_errors=True)


@dataclass
class Restored:
    step: int
    layout: Layout
    shards: list[dict]  # per saved shard: {"params": flat, "optimizer": state_dict, ...}
    manifest: dict
    buffers: Optional[dict[str, torch.Tensor]] = None  # None: saved before buffers were
    tables: Optional[dict] = None  # embedding tables: specs, partition, num_ps, paths (checked,
    # not loaded here: each PS reads its rows from them itself)


def _load_step(step: int, folder: Path) -> Restored:
    """Load and verify one step; raises ValueError naming the bad file and what is wrong."""
    mpath = folder / MANIFEST
    if not mpath.exists():
        raise ValueError(f"{mpath} is missing (the checkpoint was never committed)")
    try:
        manifest = json.loads(mpath.read_bytes())
    except (OSError, ValueError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise ValueError(f"{mpath} is unreadable ({e})") from None
    problem, layout = manifest_problem(manifest, step)
    if problem:
        raise ValueError(f"{mpath} is malformed: {problem}")
    shards: list[dict] = []
    for k, entry in enumerate(manifest["files"]):
        path = folder / entry["file"]
        state = _load_file(path, entry)
        keys = set(shards[0]["optimizer"]["state"].get(0, {})) if shards else None
        problem = shard_state_problem(state, k, step, layout.shard_numel[k], keys)
        if problem:
            raise ValueError(f"{path} does not match {mpath}: {problem}")
        shards.append(state)
    buffers = None
    if "buffers" in manifest:
        path = folder / BUFFERS_FILE
        saved = _load_file(path, manifest["buffers"])
        problem = buffers_problem(saved, step)
        if problem:
            raise ValueError(f"{path} does not match {mpath}: {problem}")
        buffers = saved["buffers"]
    tables = None
    if "tables" in manifest:
        t = manifest["tables"]
        paths = []
        for entry in t["files"]:
            path = folder / entry["file"]
            _check_file(path, entry)
            paths.append(str(path))
        tables = {"specs": t["specs"], "partition": t["partition"], "num_ps": t["num_ps"],
                  "paths": paths}
    return Restored(step, layout, shards, manifest, buffers, tables)


def _check_file(path: Path, entry: dict) -> None:
    """A file of a step, checked against its manifest entry (size and sha256)."""
    try:
        got = file_digest(path)
    except OSError as e:
        raise ValueError(f"{path} is unreadable ({e.strerror})") from None
    if got["bytes"] != entry["bytes"] or got["sha256"] != entry["sha256"]:
        raise ValueError(f"{path} is truncated or corrupt ({got['bytes']} bytes, manifest says "
                         f"{entry['bytes']})")


def _load_file(path: Path, entry: dict):
    """One file of a step, checked against its manifest entry, loaded with weights_only."""
    _check_file(path, entry)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ValueError(f"{path} is unreadable ({e.strerror})") from None
    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except Exception as e:
        raise ValueError(f"{path} is unreadable ({type(e).__name__})") from None


def find_latest(root: Optional[str]) -> Optional[Restored]:
    """The newest complete checkpoint under `root`, or None; bad ones are skipped with a warning."""
    if not root:
        return None
    for step, folder in steps_on_disk(Path(root)):
        try:
            return _load_step(step, folder)
        except ValueError as e:
            log.warning("checkpoint step %d skipped: %s", step, e)
    return None


def reshard(restored: Restored, new: Layout) -> tuple[list[torch.Tensor], list[dict]]:
    """Re-split a checkpoint made with one layout (any number of PS) into layout `new`.

    Returns the flat params per new shard and each one's optimizer state for its one tensor
    (`optimizer.state[param]`'s form, {} before the first step; hyperparameters are not in it:
    they come from the current config)."""
    old = restored.layout
    if dict(old.shapes) != dict(new.shapes):
        diff = sorted(set(old.shapes) ^ set(new.shapes)) or [
            n for n in new.shapes if new.shapes[n] != old.shapes.get(n)]
        raise PsrpcError(f"checkpoint step-{restored.step} was made for another model "
                         f"(parameters differ: {diff[:3]}); use another checkpoint.dir")
    params = new.split(old.join([s["params"] for s in restored.shards]))
    saved = [s["optimizer"]["state"].get(0, {}) for s in restored.shards]
    per_shard: list[dict] = [{} for _ in range(new.num_shards)]
    for key, value in saved[0].items():
        if torch.is_tensor(value) and value.dim() == 1 and value.numel() == old.shard_numel[0]:
            flats = new.split(old.join([s[key] for s in saved]))  # per-element state
            for k in range(new.num_shards):
                per_shard[k][key] = flats[k]
        else:  # scalars (Adam's step): the same on every shard
            for k in range(new.num_shards):
                per_shard[k][key] = value.clone() if torch.is_tensor(value) else value
    return params, per_shard


# Counters every shard keeps alike (each one applies every accepted push), and per-shard event
# counters that the summary takes the maximum of across shards (a push whose gradient is
# non-finite is rejected by every shard its non-finite part reaches: once per push, not per
# shard).
_SHARED_COUNTERS = ("applied_pushes", "samples", "per_worker_applied")
_MAX_COUNTERS = ("nan_rejected", "staleness_max")


def shard_stats(restored: Restored, new: Layout) -> list[Optional[dict]]:
    """The counters each new shard starts from, so that every count is carried over once.

    Same layout: each shard continues its own. Another layout: a shard's own history cannot be
    split or merged, so the new shard 0 (the clock shard, whose counters the summary reports)
    takes the old shard 0's, with the largest rejection count and staleness of any old shard; the other
    new shards take only the counters every shard shares."""
    saved = [s.get("stats") for s in restored.shards]
    if any(s is None for s in saved):  # written before counters were saved
        return [None] * new.num_shards
    if restored.layout == new:
        return [dict(s) for s in saved]
    first = dict(saved[0])
    for key in _MAX_COUNTERS:
        first[key] = max(s.get(key, 0) for s in saved)
    shared = {k: saved[0][k] for k in _SHARED_COUNTERS if k in saved[0]}
    return [first] + [dict(shared) for _ in range(new.num_shards - 1)]
