"""Writing checkpoints: one file per shard, written by its PS, and a manifest written last by the
chief (the commit point).

    checkpoint.dir/step-N/shard-K.pt      {"format", "shard", "version", "params", "optimizer",
                                           "stats"}
    checkpoint.dir/step-N/buffers.pt      {"format", "step", "buffers"}: the chief's replica's
                                          buffers (BatchNorm statistics) at step N
    checkpoint.dir/step-N/manifest.json   the commit point: step, layout, every file's size/sha256

Files go to a temporary name, then are renamed, and the folder is synced; a step folder that
holds a manifest is never written to again. Reading them back: psrpc/checkpoint/restore.py.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Optional

import torch

from psrpc.checkpoint.manifest import (BUFFERS_FILE, FORMAT, MANIFEST, file_digest, shard_file,
                                       step_dir, step_problem, steps_on_disk)
from psrpc.cluster.layout import Layout
from psrpc.errors import PsrpcError

log = logging.getLogger("psrpc")


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


def prune(root: Path, keep: int, committed: int, good: Optional[set] = None) -> None:
    """Keep the newest `keep` committed checkpoints that load; drop older committed ones and
    uncommitted ones older than `committed`. A committed step that does not check out (a file
    truncated or corrupted since) does not count toward `keep`: it is moved aside to
    step-N.corrupt, so that it neither pushes a good checkpoint out nor blocks a new save of
    its step. `good`: steps known to check out (the saver's own); those found to are added."""
    good = set() if good is None else good
    kept = 0
    for step, folder in steps_on_disk(root):
        if not (folder / MANIFEST).exists():
            if step < committed:
                shutil.rmtree(folder, ignore_errors=True)
            continue
        if step not in good:
            problem = step_problem(step, folder)
            if problem is not None:
                _set_aside(folder, problem)
                continue
            good.add(step)
        if kept < keep:
            kept += 1
        else:
            shutil.rmtree(folder, ignore_errors=True)
            good.discard(step)


def _set_aside(folder: Path, problem: str) -> None:
    """A committed step that does not load: renamed (never deleted: someone may want to see
    what happened to it), out of the way of restores and saves."""
    target = folder.with_name(folder.name + ".corrupt")
    n = 1
    while target.exists():
        n += 1
        target = folder.with_name(f"{folder.name}.corrupt{n}")
    os.rename(folder, target)
    log.warning("checkpoint %s does not load (%s): moved to %s; it does not count toward "
                "checkpoint.keep", folder.name, problem, target.name)
