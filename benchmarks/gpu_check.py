"""One-shot GPU check, under 10 minutes on one GPU: the CUDA tests (`pytest -m gpu`: CUDA workers
against CPU workers of the same config, several shards pushed during backward, bfloat16 on the
wire, model parallel, resnet18 with BatchNorm, async, a NaN from a CUDA worker), then a short
timing of CUDA against CPU workers. Writes results.json and results.md to
benchmarks/results/gpu_check/ and exits non-zero when a test failed or CUDA is missing.

    python -m benchmarks.gpu_check [models=[cnn] steps=40]
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

from benchmarks.common import ROOT, bench_config, header, run_psrpc


def run_tests(b) -> list[dict]:
    """pytest -m gpu, one row per test: outcome, seconds, and the differences it measured."""
    with tempfile.TemporaryDirectory(prefix="psrpc-gpu-check-") as tmp:
        xml = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
               f"--junitxml={xml}", *b.tests]
        print("$ " + " ".join(cmd[1:]), flush=True)
        try:
            done = subprocess.run(cmd, cwd=ROOT, text=True, capture_output=True,
                                  timeout=b.tests_timeout_s)
            print(done.stdout[-4000:], done.stderr[-2000:], sep="\n", flush=True)
        except subprocess.TimeoutExpired:
            return [{"test": "pytest -m gpu", "outcome": "timeout",
                     "message": f"did not finish within {b.tests_timeout_s} s"}]
        if not xml.exists():  # pytest itself failed (e.g. a collection error)
            tail = (done.stdout + done.stderr).strip().splitlines() or ["no output"]
            return [{"test": "pytest -m gpu", "outcome": "error", "message": tail[-1][:200]}]
        return [_row(case) for case in ET.parse(xml).iter("testcase")]


def _row(case) -> dict:
    row = {"test": case.get("name"), "outcome": "passed", "seconds": float(case.get("time", 0))}
    for tag in ("failure", "error", "skipped"):
        node = case.find(tag)
        if node is not None:
            row["outcome"] = {"failure": "failed"}.get(tag, tag)
            lines = (node.get("message") or "").strip().splitlines()
            row["message"] = lines[0][:200].replace("|", "/") if lines else ""
    for prop in case.iter("property"):
        row[prop.get("name")] = float(prop.get("value"))
    return row


def run_timing(b) -> list[dict]:
    """samples/s of the same run with CPU and with CUDA workers (TF32 left at torch's default)."""
    shape = ",".join(str(x) for x in b.image_shape)
    rows = []
    for model in b.models:
        rates = {}
        for device in b.devices:
            s = run_psrpc([f"model={model}", f"data.image_shape=[{shape}]",
                           f"cluster.num_workers={b.workers}", f"train.batch_size={b.batch_size}",
                           f"train.steps={b.steps}", f"train.untimed_steps={b.warmup}",
                           f"train.log_every={b.steps}", "data.size=8192", "data.test_size=0",
                           f"train.device={device}"], timeout_s=b.run_timeout_s)
            rates[device] = s["samples_per_s"]
            rows.append({"model": model, "device": device, "samples_per_s": rates[device],
                         "wall_s": s["wall_s"]})
            print(rows[-1], flush=True)
        for r in rows[-len(b.devices):]:
            r["vs_cpu"] = round(r["samples_per_s"] / rates["cpu"], 2) if "cpu" in rates else None
    return rows


def main(argv: list[str]) -> int:
    b = bench_config("gpu_check", argv)
    meta = header()
    has_cuda = torch.cuda.is_available()
    tests = run_tests(b)
    timing = run_timing(b) if has_cuda else []
    ran = [t for t in tests if t["outcome"] != "skipped"]
    ok = has_cuda and bool(ran) and all(t["outcome"] == "passed" for t in ran)
    out = ROOT / b.out
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(
        {**meta, "ok": ok, "cuda": has_cuda, "tests": tests, "timing": timing}, indent=1))
    (out / "results.md").write_text(markdown(meta, ok, has_cuda, tests, timing, b))
    print((out / "results.md").read_text(), flush=True)
    print(f"# results in {out}", flush=True)
    return 0 if ok else 1


def markdown(meta, ok, has_cuda, tests, timing, b) -> str:
    m = meta["machine"]
    lines = ["# GPU check", "", f"Command: `{meta['command']}`  ",
             f"Commit: `{meta['commit']}`, {meta['date']}  ",
             f"Machine: {m['cuda'] or 'no CUDA'}; {m['cpu']}, {m['cores']} cores, "
             f"torch {m['torch']}", "",
             f"**{'OK' if ok else 'NOT OK'}**" + ("" if has_cuda else ": no CUDA on this machine"),
             "", "## CUDA tests (`pytest -m gpu`, TF32 off)", "",
             "| test | outcome | s | max abs diff | max rel diff | message |",
             "|---|---|---|---|---|---|"]
    for t in tests:
        lines.append(f"| {t['test']} | {t['outcome']} | {t.get('seconds', 0):.1f} | "
                     f"{_g(t.get('max_abs_diff'))} | {_g(t.get('max_rel_diff'))} | "
                     f"{t.get('message', '')} |")
    lines += ["", f"## CUDA vs CPU workers ({b.workers} workers × batch {b.batch_size}, "
              f"{b.steps} steps, samples/s after step {b.warmup}, TF32 at torch's default)", ""]
    if timing:
        lines += ["| model | device | samples/s | vs cpu | wall s |", "|---|---|---|---|---|"]
        lines += [f"| {r['model']} | {r['device']} | {r['samples_per_s']} | {r['vs_cpu']} | "
                  f"{r['wall_s']} |" for r in timing]
    else:
        lines.append("Not run: no CUDA.")
    return "\n".join(lines) + "\n"


def _g(x) -> str:
    return "" if x is None else f"{x:.2g}"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
