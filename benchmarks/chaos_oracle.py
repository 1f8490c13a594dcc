"""The fault campaign's oracle (benchmarks/chaos.py): what a faulted run is compared with, read
from its files, not from what the system says of itself.

- `redone_steps`: the steps the chief computed again, from its own step log (metrics.jsonl, one
  record a step with train.log_every=1): a training record whose step is not above every step
  logged before it is a step done again (after a rollback, or a restart from a checkpoint).
- `Oracles`: the uninterrupted run of a schedule's config (its overrides, without the fault),
  run once per config and shared by every schedule of that config.
- `compare`: the faulted run's model.pt and exported tables against the oracle's, bit for bit
  (torch.equal per tensor).
- `verdict`: "equal", "named divergence: <reasons>" (the summary's `inexact` says why the run
  is not an uninterrupted one by design: a worker lost, a sync round closed without a worker,
  a step passed without its update), or "SILENT DIVERGENCE: <what differs>".

Which runs have an oracle: update=sync with every worker in each round. Sync with backup workers
(update.replicas_to_aggregate < W) has none: which gradients make a round is the order they
arrive in, a matter of timing, so two uninterrupted runs of one config already differ. Async and
bounded async have none for the same reason; their runs are held to their own invariants.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Callable, Optional

import torch

EQUAL = "equal"
NAMED = "named divergence"
SILENT = "SILENT DIVERGENCE"
NONE = "no oracle"
BROKEN = "OUTPUTS DO NOT LOAD"


def redone_steps(metrics: Path) -> int:
    """Steps computed again, from the chief's step log: the training records (those with
    "samples": not the evaluations') whose step is not above the highest logged before them.
    0 where there is no log. Counts every step again with train.log_every=1."""
    top, redone = None, 0
    for step in logged_steps(metrics):
        if top is not None and step <= top:
            redone += 1
        top = step if top is None else max(top, step)
    return redone


def logged_steps(metrics: Path) -> list[int]:
    """The step of each training record of metrics.jsonl, in order (a torn last line skipped)."""
    try:
        lines = Path(metrics).read_text(errors="replace").splitlines()
    except OSError:
        return []
    steps = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and "samples" in record and "step" in record:
            steps.append(int(record["step"]))
    return steps


def differences(a: dict, b: dict, what: str = "") -> list[str]:
    """Where two state_dicts (or tables: name -> tensor, or an object with .ids and .weight)
    are not equal bit for bit: a line each, naming the key and by how much."""
    if a.keys() != b.keys():
        return [f"{what}keys differ: {sorted(set(a) ^ set(b))}"]
    out = []
    for k in a:
        for name, x, y in _tensors(k, a[k], b[k]):
            if x.shape != y.shape or x.dtype != y.dtype:
                out.append(f"{what}{name}: shape/dtype {tuple(x.shape)}/{x.dtype} against "
                           f"{tuple(y.shape)}/{y.dtype}")
            elif not torch.equal(x, y):
                out.append(f"{what}{name}: max |diff| {_maxdiff(x, y):.3g}")
    return out


def _tensors(key: str, x, y) -> list[tuple]:
    """(name, tensor, tensor) pairs of one entry: a tensor, or a dynamic table's ids and rows."""
    if torch.is_tensor(x):
        return [(key, x, y)]
    return [(f"{key}.ids", x.ids, y.ids), (f"{key}.weight", x.weight, y.weight)]


def _maxdiff(x: torch.Tensor, y: torch.Tensor) -> float:
    if x.is_floating_point():
        return (x.double() - y.double()).abs().max().item()
    return float((x != y).sum().item())  # integer tensors: how many entries differ


def outputs(out_dir: Path) -> Optional[dict]:
    """{"model": state_dict, "tables": {name: table} or {}} of a run, None without model.pt."""
    out_dir = Path(out_dir)
    if not (out_dir / "model.pt").exists():
        return None
    model = torch.load(out_dir / "model.pt", weights_only=True)
    tables = {}
    if (out_dir / "tables" / "index.json").exists():
        from psrpc.sparse import load_tables
        tables = load_tables(str(out_dir))
    return {"model": model, "tables": tables}


def compare(run: dict, oracle: dict) -> list[str]:
    """What differs between a run's outputs and the oracle's ([]: equal bit for bit)."""
    return (differences(run["model"], oracle["model"], "model.pt ")
            + differences(run["tables"], oracle["tables"], "tables "))


def inexact(summary: Optional[dict]) -> list[str]:
    """The reasons the summary names for the run not being an uninterrupted one by design (a
    shortfall it calls UNEXPLAINED is no design: not a reason)."""
    return [r for r in (summary or {}).get("inexact") or [] if not r.startswith("UNEXPLAINED")]


def verdict(diffs: list[str], summary: Optional[dict]) -> str:
    """equal / named divergence: reasons / SILENT DIVERGENCE: the first differences."""
    if not diffs:
        return EQUAL
    reasons = inexact(summary)
    if reasons:
        return f"{NAMED}: " + "; ".join(reasons)
    more = f" (+{len(diffs) - 3} more)" if len(diffs) > 3 else ""
    return f"{SILENT}: " + "; ".join(diffs[:3]) + more


def kind(oracle: Optional[str]) -> str:
    """The verdict's kind (EQUAL, NAMED, SILENT, BROKEN or NONE) for the tables' counts."""
    for k in (EQUAL, NAMED, SILENT, BROKEN):
        if oracle and oracle.startswith(k):
            return k
    return NONE


class Oracles:
    """The uninterrupted run of each config, run once and kept by its key (what makes the
    config: its launcher, steps and overrides), under `root`."""

    def __init__(self, root: Path, bound_s: float):
        self.root, self.bound_s = Path(root), bound_s
        self.cache: dict[tuple, tuple[Optional[dict], str]] = {}
        self.runs = 0

    def get(self, key: tuple, start: Callable) -> tuple[Optional[dict], str]:
        """(the oracle's outputs, "") or (None, why there are none); `start(folder)` starts
        the uninterrupted run (something with .proc, .out, .stderr_path and .kill_all(), as
        chaos_faults.Run) the first time `key` is asked for."""
        if key not in self.cache:
            self.runs += 1
            self.cache[key] = self._run(start(self.root / f"oracle{self.runs:03d}"))
        return self.cache[key]

    def _run(self, run) -> tuple[Optional[dict], str]:
        try:
            run.proc.wait(timeout=self.bound_s)
        except subprocess.TimeoutExpired:
            run.kill_all()
            run.proc.wait(timeout=30)
            return None, f"the uninterrupted run did not end within {self.bound_s:g} s"
        finally:
            run.kill_all()
        found = outputs(run.out) if run.proc.returncode == 0 else None
        if found is None:
            tail = run.stderr_path.read_text(errors="replace").strip().splitlines()[-1:]
            return None, (f"the uninterrupted run wrote no outputs (exit "
                          f"{run.proc.returncode}): " + " | ".join(tail))
        return found, ""
