"""What every benchmark shares: configs (Hydra's compose API), running psrpc and its peers side
by side, and writing results (JSON, CSV, Markdown table, PNG plot) with the command, the commit
and the machine that produced them."""

from __future__ import annotations

import csv
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parents[1]
BENCH_CONF = ROOT / "benchmarks" / "conf"
BENCH_INSTALL = 'pip install -e ".[bench]"'  # what the plots need (matplotlib), beside the tables
NO_PLOT = f"matplotlib is not installed: no plot.png, the tables only ({BENCH_INSTALL} adds it)"


def bench_config(name: str, argv: list[str]):
    """The benchmark's own options: benchmarks/conf/<name>.yaml plus command-line overrides."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(BENCH_CONF), version_base="1.3"):
        return compose(name, overrides=argv)


def psrpc_config(overrides: list[str], **factories):
    """The typed psrpc Config that `python -m psrpc <overrides>` would run, checked."""
    from psrpc.api import compose
    from psrpc.validate import check_run

    cfg = compose(list(overrides), cwd=str(ROOT), **factories)
    check_run(cfg)
    return cfg


def run_psrpc(overrides: list[str], replica_cls=None, timeout_s: float = 1800,
              extra_files=()) -> dict:
    """One psrpc run through the real launcher; returns its summary.json (plus any
    `extra_files`, JSON files a hook wrote into the run's out_dir)."""
    from psrpc.launch import launch

    cfg = psrpc_config(overrides)
    with tempfile.TemporaryDirectory(prefix="psrpc-bench-") as out:
        launch(cfg, Path(out), timeout_s=timeout_s, replica_cls=replica_cls)
        summary = json.loads((Path(out) / "summary.json").read_text())
        for name in extra_files:
            summary[name] = json.loads((Path(out) / name).read_text())
    return summary


def machine() -> dict:
    import torch

    cpu = "unknown"
    try:
        cpu = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo")
                   if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "platform": platform.platform(),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                             capture_output=True).stdout.strip()
        code = ["psrpc", "conf", "benchmarks/*.py", "benchmarks/conf"]  # not docs or results
        dirty = subprocess.run(["git", "status", "--porcelain", "--"] + code,
                               cwd=ROOT, text=True, capture_output=True).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except OSError:
        return "unknown"


def command() -> str:
    return "python -m " + " ".join([Path(sys.argv[0]).with_suffix("").relative_to(ROOT).as_posix()
                                    .replace("/", ".")] + [shlex.quote(a) for a in sys.argv[1:]])


def header() -> dict:
    meta = {"command": command(), "commit": commit(), "machine": machine(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    print(f"# {meta['command']}\n# commit {meta['commit']} on {meta['machine']['cpu']}, "
          f"{meta['machine']['cores']} cores, torch {meta['machine']['torch']}", flush=True)
    if _pyplot() is None:  # said before the run, not only after it
        print(f"# {NO_PLOT}", flush=True)
    return meta


def _pyplot():
    """matplotlib.pyplot on the Agg backend, or None where matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_results(out_dir: Path, meta: dict, rows: list[dict], columns: list[str],
                  title: str, plot: Optional[Callable] = None, notes: str = "") -> None:
    """results.json, results.csv, results.md (table + command + machine) and plot.png (only
    where matplotlib is installed: otherwise one line says how to install it)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
    with open(out_dir / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=sorted({k for r in rows for k in r}))
        w.writeheader()
        w.writerows(rows)
    lines = [f"# {title}", "", f"Command: `{meta['command']}`  ",
             f"Commit: `{meta['commit']}`, {meta['date']}  ",
             f"Machine: {meta['machine']['cpu']}, {meta['machine']['cores']} cores, "
             f"torch {meta['machine']['torch']}, Python {meta['machine']['python']}", ""]
    if notes:
        lines += [notes, ""]
    lines += ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(r.get(c)) for c in columns) + " |")
    table = lines[-len(rows) - 2:]
    plt = _pyplot() if plot is not None else None
    if plot is not None and plt is None:
        print(f"# {NO_PLOT}", flush=True)
    elif plot is not None:
        fig = plot(plt, rows)
        fig.savefig(out_dir / "plot.png", dpi=110, bbox_inches="tight")
        plt.close(fig)
        lines += ["", "![plot](plot.png)"]
    (out_dir / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(table), flush=True)
    print(f"# results in {out_dir}", flush=True)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 10 else f"{v:.1f}"
    return "" if v is None else str(v)
