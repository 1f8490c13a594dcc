"""`python -m psrpc --help`: every key of the config the given overrides compose, with its
value there and its meaning, the one-line docstring that follows the field in psrpc/config.py.
Generated from the schema and the YAML each time, so it cannot drift from either.

(Hydra's own help template can show the composed YAML, not what each key means; `--hydra-help`
still prints Hydra's.)
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
from functools import lru_cache
from pathlib import Path
from typing import Any, Sequence

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

import psrpc
from psrpc import config as schema

CONF_DIR = Path(__file__).resolve().parent / "conf"
HIDDEN_GROUPS = {"hydra", "schema"}  # Hydra's own; the typed schemas the groups extend
WIDTH = 100

USAGE = """\
psrpc {version}: parameter-server training on torch.distributed.rpc

Usage:
  python -m psrpc [group=option ...] [key=value ...]     the whole cluster, on this machine
  torchrun --nnodes=N --nproc-per-node=M -m psrpc ...     one process per rank (many hosts)
  python -m psrpc -m key=a,b ...                          a sweep (Hydra multirun)
  python -m psrpc update=async --help                     the keys that config has

Groups (group=option; * marks the default):
{groups}

Keys (key = value in this config; what it means):"""


@lru_cache(maxsize=None)
def field_docs(cls: type) -> dict[str, str]:
    """{field: its docstring} for a schema dataclass, its bases' first (a field documented
    again in a subclass takes the subclass's)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass is object or not dataclasses.is_dataclass(klass):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        body = tree.body[0].body
        for node, after in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                    and isinstance(after.value.value, str)):
                docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def groups(choices: dict) -> str:
    """Each config group with its options (YAML under psrpc/conf, classes registered in
    psrpc/config.py such as the optimizers), the chosen one starred."""
    store = ConfigStore.instance()
    options: dict[str, set] = {}
    for folder in (p for p in CONF_DIR.iterdir() if p.is_dir()):
        options.setdefault(folder.name, set()).update(p.stem for p in folder.glob("*.yaml"))
    for group in store.list(""):
        if not group.endswith(".yaml") and group not in HIDDEN_GROUPS:
            options.setdefault(group, set()).update(Path(n).stem for n in store.list(group))
    lines = []
    for group in sorted(set(options) - HIDDEN_GROUPS):
        named = [o + ("*" if o == choices.get(group) else "") for o in sorted(options[group])]
        lines.append(f"  {group:<11} {', '.join(named)}")
    return "\n".join(lines)


def _value(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(map(_value, value)) + "]"
    if isinstance(value, bool):
        return str(value).lower()
    return "null" if value is None else str(value)


def _entry(key: str, value: Any, doc: str = "") -> str:
    line = f"  {key} = {_value(value)}"
    if not doc:
        return line
    return line + "\n" + textwrap.fill(doc, WIDTH, initial_indent="      ",
                                       subsequent_indent="      ")


def section(name: str, node: Any, doc: str) -> list[str]:
    """One top-level key: a schema section (its fields with their docstrings), a factory
    group (its arguments under the group's meaning), or a value of its own."""
    if dataclasses.is_dataclass(node):
        docs = field_docs(type(node))
        head = ["", textwrap.fill(f"{name}: {doc}", WIDTH, subsequent_indent="  ")]
        return head + [_entry(f"{name}.{f.name}", getattr(node, f.name), docs.get(f.name, ""))
                       for f in dataclasses.fields(node)]
    if isinstance(node, dict):
        head = ["", textwrap.fill(f"{name}: {doc}", WIDTH, subsequent_indent="  ")]
        return head + [_entry(f"{name}.{k}", v) for k, v in node.items()]
    return [_entry(name, node, doc)]


def text(overrides: Sequence[str] = ()) -> str:
    """The help for the config `overrides` compose (none: the defaults)."""
    schema.register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        choices = hydra_compose("config", overrides=list(overrides),
                                return_hydra_config=True).hydra.runtime.choices
        # as composed: `fault` stays null without fault=inject (a run gets FaultConfig())
        cfg = OmegaConf.to_object(hydra_compose("config", overrides=list(overrides)))
    docs = field_docs(schema.Config)
    out = [USAGE.format(version=psrpc.__version__, groups=groups(choices))]
    for f in dataclasses.fields(cfg):
        out += section(f.name, getattr(cfg, f.name), docs.get(f.name, ""))
    return "\n".join(out) + "\n"


def asked(argv: Sequence[str]) -> bool:
    return "--help" in argv or "-h" in argv


def overrides_of(argv: Sequence[str]) -> list[str]:
    return [a for a in argv if not a.startswith("-")]
