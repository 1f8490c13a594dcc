"""Restoring checkpoints: the newest step whose manifest and files all check out (a truncated,
unreadable, malformed or uncommitted step is skipped with a warning naming the file;
psrpc/checkpoint/manifest.py says what is checked), loaded with weights_only=True, and re-split
for any number of PS: parameters and the optimizer's per-element state are joined by the saved
layout and split by the new one. The buffers go back into every replica.
"""

from __future__ import annotations

import io
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from psrpc.checkpoint.manifest import (BUFFERS_FILE, MANIFEST, buffers_problem, file_problem,
                                       manifest_problem, shard_state_problem, steps_on_disk)
from psrpc.cluster.layout import Layout
from psrpc.errors import PsrpcError

log = logging.getLogger("psrpc")


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
            problem = file_problem(path, entry)
            if problem:
                raise ValueError(problem)
            paths.append(str(path))
        tables = {"specs": t["specs"], "partition": t["partition"], "num_ps": t["num_ps"],
                  "paths": paths}
    return Restored(step, layout, shards, manifest, buffers, tables)


def _load_file(path: Path, entry: dict):
    """One file of a step, checked against its manifest entry, loaded with weights_only."""
    problem = file_problem(path, entry)
    if problem:
        raise ValueError(problem)
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
