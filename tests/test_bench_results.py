"""What every benchmark writes at its end (benchmarks/common.py `write_results`): where
matplotlib is not installed (`pip install -e ".[dev]"` alone), the JSON, CSV and Markdown
table are written and one line says how to install the plots, instead of a traceback after
the whole run."""

import json
import sys

import pytest

from benchmarks import common

META = {"command": "python -m benchmarks.x", "commit": "abc1234", "date": "2026-12-01 10:00:00",
        "machine": {"cpu": "a CPU", "cores": 2, "torch": "2.x", "python": "3.11"}}
ROWS = [{"system": "psrpc", "samples_per_s": 123.4}, {"system": "ddp", "samples_per_s": 99.0}]


def _plot(plt, rows):
    fig, ax = plt.subplots()
    ax.bar([r["system"] for r in rows], [r["samples_per_s"] for r in rows])
    return fig


def test_without_matplotlib_the_tables_are_written_and_one_line_says_how_to_install(
        tmp_path, monkeypatch, capsys):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises
    common.write_results(tmp_path, META, ROWS, ["system", "samples_per_s"], "A benchmark",
                         plot=_plot)
    assert json.loads((tmp_path / "results.json").read_text())["rows"] == ROWS
    assert (tmp_path / "results.csv").read_text().splitlines()[0] == "samples_per_s,system"
    md = (tmp_path / "results.md").read_text()
    assert "| psrpc | 123.4 |" in md and "plot.png" not in md
    assert not (tmp_path / "plot.png").exists()
    out = capsys.readouterr().out
    assert [ln for ln in out.splitlines() if 'pip install -e ".[bench]"' in ln], out


def test_with_matplotlib_the_plot_is_written_too(tmp_path):
    pytest.importorskip("matplotlib", reason='the plot needs pip install -e ".[bench]"')
    common.write_results(tmp_path, META, ROWS, ["system", "samples_per_s"], "A benchmark",
                         plot=_plot)
    assert (tmp_path / "plot.png").stat().st_size > 0
    assert "![plot](plot.png)" in (tmp_path / "results.md").read_text()
