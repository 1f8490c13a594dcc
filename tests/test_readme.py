"""README.md, checked as a newcomer would use it.

Every single-machine `python -m psrpc ...` command in README's ```bash blocks (a line of its own
or after `&&`) runs in a subprocess, shortened: `train.steps=20 train.log_every=10` are appended
to keep the suite quick, `train.device=cpu` as everywhere in the suite, and `out_dir=<tmp>/out`
so that the outputs can be checked. The command runs in a temporary folder that links the
repository's `examples/` (what README's commands name, as they would find it at the root), so
Hydra's own `outputs/` lands there, not in the checkout. It must exit with 0 and write
`model.pt` and `summary.json`.

Not run: commands with a `<placeholder>` (data the suite does not have, such as MNIST or
MovieLens, or a folder of the reader's), sweeps (`-m`: several runs), and every line that is not
`python -m psrpc` (torchrun and srun over several hosts, pip, pytest).

Also: README stays short, its quick start is what `.ci/run` runs, and its links lead to files
and headings that exist.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.timeout(600)

README = ROOT / "README.md"
SHORTEN = ["train.steps=20", "train.log_every=10", "train.device=cpu"]
PLACEHOLDER = re.compile(r"<[^<>\s][^<>]*>")


@dataclass
class Command:
    text: str                # as README writes it
    args: list[str]          # what follows `python -m psrpc`
    skip: Optional[str]      # why it is not run, or None


def bash_blocks(text: str) -> list[str]:
    return re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M)


def command_lines(block: str) -> list[str]:
    """The block's commands: continuation lines (a trailing backslash) joined, comment lines
    dropped."""
    lines, current = [], ""
    for line in block.splitlines():
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1].strip() + " "
            continue
        current += line.strip()
        if current.strip() and not current.lstrip().startswith("#"):
            lines.append(current.strip())
        current = ""
    return lines


def psrpc_commands(text: str) -> list[Command]:
    """Every `python -m psrpc ...` of README's bash blocks, each with why it is skipped."""
    found = []
    for block in bash_blocks(text):
        for line in command_lines(block):
            for segment in re.split(r"\s&&\s", line):
                segment = segment.strip()
                if not segment.startswith("python -m psrpc"):
                    continue
                args = shlex.split(segment, comments=True)[3:]
                skip = None
                if PLACEHOLDER.search(segment):
                    skip = (f"needs {', '.join(PLACEHOLDER.findall(segment))}, which the suite "
                            "does not have")
                elif "-m" in args or "--multirun" in args:
                    skip = "a sweep: several runs"
                found.append(Command(segment.split("#")[0].strip(), args, skip))
    return found


COMMANDS = psrpc_commands(README.read_text())


def _params():
    for c in COMMANDS:
        marks = [pytest.mark.skip(reason=c.skip)] if c.skip else []
        yield pytest.param(c, marks=marks, id=" ".join(c.args) or "(defaults)")


@pytest.mark.parametrize("command", list(_params()))
def test_a_readme_command_runs(tmp_path, command: Command):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    (cwd / "examples").symlink_to(ROOT / "examples", target_is_directory=True)
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "psrpc", *command.args, *SHORTEN,
                        f"out_dir={out}"], cwd=cwd, capture_output=True, text=True,
                       timeout=240, env={**os.environ})
    assert r.returncode == 0, f"{command.text}\n{(r.stdout + r.stderr)[-4000:]}"
    assert (out / "model.pt").is_file() and (out / "summary.json").is_file(), command.text
    assert json.loads((out / "summary.json").read_text())["steps"] == 20


def test_the_readme_has_a_few_commands_to_run_and_some_it_cannot():
    """The parser found README's commands: a handful that the suite runs (more would make it
    slow), and the real-data ones, skipped."""
    runnable = [c for c in COMMANDS if c.skip is None]
    assert 3 <= len(runnable) <= 6, [c.text for c in runnable]
    assert any(c.skip and "MNIST" in c.skip for c in COMMANDS), [c.text for c in COMMANDS]


def test_the_readme_is_short():
    assert len(README.read_text().splitlines()) <= 260


def test_the_quick_start_is_what_ci_runs():
    """`.ci/run` installs and tests exactly as README's quick start says."""
    quick = command_lines(bash_blocks(README.read_text())[0])
    assert quick == ['pip install -e ".[dev]" && python -m psrpc', "pytest"]
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert 'pip install -e ".[dev]"' in ci and "pytest" in ci


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
    return {github_slug(m) for m in re.findall(r"^#+\s+(.*?)\s*$", text, re.M)}


def test_every_link_of_the_readme_leads_somewhere():
    """Relative links lead to files that exist, and anchors to headings of the file."""
    text = README.read_text()
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        file = (README.parent / path) if path else README
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(target)
    assert not broken, broken
