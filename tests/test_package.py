"""The wheel is the product: it holds every config, installs without the checkout and runs from
anywhere; `--help` gives every key its meaning, generated from the schema."""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import psrpc
from psrpc import config as schema
from psrpc import helptext

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "psrpc" / "conf"


def _schema_classes() -> list[type]:
    return [c for c in vars(schema).values()
            if isinstance(c, type) and dataclasses.is_dataclass(c) and c.__module__ == schema.__name__]


@pytest.mark.parametrize("cls", _schema_classes(), ids=lambda c: c.__name__)
def test_every_schema_field_has_a_docstring(cls):
    docs = helptext.field_docs(cls)
    if cls is schema.OptimConfig:  # (its `name` is each optimizer's own: documented there)
        docs = {**docs, "name": "-"}
    missing = [f.name for f in dataclasses.fields(cls) if not docs.get(f.name)]
    assert not missing, f"{cls.__name__}: no docstring after {missing} in psrpc/config.py"


def _leaves(node, prefix=""):
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _leaves(v, f"{prefix}{k}.")
    else:
        yield prefix[:-1]


@pytest.mark.parametrize("overrides", [[], ["update=async"], ["parallel=model"], ["optim=adam"],
                                       ["fault=inject"], ["+experiment=movielens_dlrm"]], ids=str)
def test_help_shows_every_key_with_its_value_and_meaning(overrides):
    text = helptext.text(overrides)
    schema.register_configs()
    with initialize_config_dir(config_dir=str(helptext.CONF_DIR), version_base="1.3"):
        composed = OmegaConf.to_container(compose("config", overrides=list(overrides)))
    lines = text.splitlines()
    for key in _leaves(composed):
        shown = [n for n, line in enumerate(lines) if line.startswith(f"  {key} = ")]
        assert shown, f"--help does not show {key} ({overrides})"
        if key.split(".")[0] in ("model", "data", "loss", "metric"):
            continue  # a factory's arguments: the group's meaning heads them
        after = lines[shown[0] + 1] if shown[0] + 1 < len(lines) else ""
        assert after.startswith("      ") and after.strip(), f"--help gives {key} no meaning"


def test_help_from_the_command_line_and_a_bad_key_named():
    ok = subprocess.run([sys.executable, "-m", "psrpc", "update=async", "--help"],
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and "update.max_staleness = null" in ok.stdout
    assert "powered by Hydra" not in ok.stdout and "schema/" not in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "psrpc", "cluster.num_wrkers=3", "--help"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "did you mean cluster.num_workers?" in bad.stderr
    assert "Traceback" not in bad.stderr


def _build_wheel(out: Path) -> Path:
    """The wheel of this tree (a copy of what goes into it: no build files in the checkout),
    built offline with the setuptools installed here."""
    src = out / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "psrpc", src / "psrpc",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(out / "dist"), str(src)], check=True, timeout=300,
                   capture_output=True)
    (wheel,) = (out / "dist").glob("psrpc-*.whl")
    return wheel


def test_the_wheel_holds_every_config_and_runs_outside_the_checkout(tmp_path):
    wheel = _build_wheel(tmp_path)
    assert wheel.name.startswith(f"psrpc-{psrpc.__version__}-")
    names = set(zipfile.ZipFile(wheel).namelist())
    configs = {f"psrpc/conf/{p.relative_to(CONF)}" for p in CONF.rglob("*.yaml")}
    assert configs and configs <= names, sorted(configs - names)
    assert any(re.search(r"\.dist-info/licenses/LICENSE$", n) for n in names)
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target",
                    str(target), str(wheel)], check=True, timeout=300, capture_output=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(target)}
    where = subprocess.run([sys.executable, "-c", "import psrpc; print(psrpc.__file__)"],
                           cwd=elsewhere, env=env, capture_output=True, text=True, timeout=60)
    assert where.stdout.startswith(str(target)), where.stdout + where.stderr
    run = subprocess.run([sys.executable, "-m", "psrpc", "train.steps=20", "train.log_every=10",
                          f"out_dir={elsewhere / 'out'}"], cwd=elsewhere, env=env,
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-2000:]
    assert (elsewhere / "out" / "model.pt").exists() and (elsewhere / "out" / "summary.json").exists()
