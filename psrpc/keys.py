"""The overrides the command line and psrpc.compose() take, read before Hydra composes them:

- a renamed key still works under its old name, with one line (RENAMED); a retired key too,
  with one line saying what replaced it (RETIRED; CHANGELOG.md records each): its value goes
  to the environment variable that took its place (psrpc/knobs.py), or, where it has one
  meaning, it is dropped;
- `fault.*` keys without `fault=...` opt in to the fault group (`fault=inject`), with a line;
- a key the schema does not have stops the start with the nearest one that it does ("did you
  mean"), instead of Hydra's advice to append it with `+`.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import os
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override, OverrideType

from psrpc import config as schema
from psrpc.errors import ConfigError

log = logging.getLogger("psrpc")


@dataclass(frozen=True)
class Retired:
    """A key no longer in the schema: `env` takes its value (None: it is dropped), `now` says
    what replaced it; `refuse(value)` is the reason a value cannot be honoured, if any."""

    now: str
    env: Optional[str] = None
    refuse: Callable[[object], Optional[str]] = lambda value: None


def _env_value(value) -> Optional[str]:
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    return None if value is None else str(value)


RETIRED = {  # since 0.3.0 (CHANGELOG.md)
    "cluster.rpc_timeout_s": Retired("derived: update.timeout_s + 60 (calls wait at the barrier); "
                                     "PSRPC_RPC_TIMEOUT_S overrides it", "PSRPC_RPC_TIMEOUT_S"),
    "cluster.rpc_threads": Retired("16 TensorPipe threads a process; PSRPC_RPC_THREADS "
                                   "overrides it", "PSRPC_RPC_THREADS"),
    "cluster.ps_threads": Retired("1 torch thread a PS; PSRPC_PS_THREADS overrides it",
                                  "PSRPC_PS_THREADS"),
    "cluster.transports": Retired("TensorPipe's uv transport; PSRPC_TP_TRANSPORTS overrides it",
                                  "PSRPC_TP_TRANSPORTS"),
    "cluster.channels": Retired("TensorPipe's cma and basic channels; PSRPC_TP_CHANNELS "
                                "overrides them", "PSRPC_TP_CHANNELS"),
}
RENAMED = {  # old key -> new key, the value kept (CHANGELOG.md)
    # (a throughput window, not optim.warmup_steps' learning-rate warmup)
    "train.warmup_steps": "train.untimed_steps",
}
ASYNC_RETIRED = {  # keys with one meaning in async (sync keeps them)
    "update.dense": Retired(
        "async keeps the dense parameters on the PS", refuse=lambda v: None if v == "ps" else
        "needs update=sync (an all-reduce waits for every worker); use update.dense=ps with "
        "update=async"),
    "update.host_push": Retired(
        "async applies each gradient on its own", refuse=lambda v: None if v in ("auto", "off")
        else "needs update=sync: in async each gradient is applied on its own; use auto or off"),
}
SECTIONS = {  # top-level keys whose keys the schema types: every option's fields
    "cluster": [schema.ClusterConfig],
    "update": [schema.SyncUpdateConfig, schema.AsyncUpdateConfig],
    "parallel": [schema.DataParallelConfig, schema.ModelParallelConfig],
    "optim": list(schema.OPTIMIZERS.values()),
    "sparse": [schema.SparseConfig],
    "train": [schema.TrainConfig],
    "checkpoint": [schema.CheckpointConfig],
    "fault": [schema.FaultConfig],
}
TOP = {f.name for f in dataclasses.fields(schema.Config)} | {"hydra", "experiment"}


def known_keys() -> list[str]:
    return sorted({f"{top}.{f.name}" for top, classes in SECTIONS.items() for cls in classes
                   for f in dataclasses.fields(cls)} | TOP)


def _parse(parser: OverridesParser, arg: str) -> Optional[Override]:
    try:
        return parser.parse_override(arg)
    except Exception:  # Hydra says what is wrong with it, as it composes
        return None


def _chosen(parsed: list, group: str, default: str) -> str:
    choices = [o.value() for o in parsed
               if o and o.key_or_group == group and not o.is_sweep_override()]
    return str(choices[-1]) if choices else default


def _check_known(key: str) -> None:
    top, _, rest = key.partition(".")
    fields = {f.name for cls in SECTIONS.get(top, []) for f in dataclasses.fields(cls)}
    if top in TOP and (top not in SECTIONS or rest.split(".")[0] in fields):
        return
    near = difflib.get_close_matches(key, known_keys(), n=1, cutoff=0.6)
    hint = f"did you mean {near[0]}? " if near else ""
    raise ConfigError(f"{key}: not a key of psrpc's config; {hint}(python -m psrpc --help lists "
                      "every key, with its meaning; +key=value adds one to a dict such as model)")


def translate(overrides: Sequence[str]) -> list[str]:
    """The overrides Hydra should compose: retired keys taken out (their values in the
    environment variables that replaced them), `fault=inject` added where fault.* keys need
    it; raises ConfigError for a key the schema does not have."""
    args = list(overrides)
    parser = OverridesParser.create()  # (its grammar is built once, not per argument)
    parsed = [_parse(parser, a) for a in args]
    update = _chosen(parsed, "update", "sync")
    out = []
    for arg, o in zip(args, parsed):
        if o is None or o.type is not OverrideType.CHANGE or "@" in o.key_or_group:
            out.append(arg)
            continue
        key = o.key_or_group
        if key in RENAMED:
            log.warning("psrpc: %s is now %s (CHANGELOG.md)", key, RENAMED[key])
            arg = arg.replace(key, RENAMED[key], 1)
            key = RENAMED[key]
        retired = RETIRED.get(key) or (ASYNC_RETIRED.get(key) if update == "async" else None)
        if retired is not None and o.is_sweep_override():
            raise ConfigError(f"{arg}: {key} is retired ({retired.now}), and a sweep cannot "
                              "set an environment variable: run one sweep per value")
        if retired is not None:
            _retire(key, o.value(), retired)
            continue
        if "." in key:
            _check_known(key)
        out.append(arg)
    if any(o and o.key_or_group.startswith("fault.") for o in parsed) and not any(
            o and o.key_or_group == "fault" for o in parsed):
        log.warning("psrpc: fault.* keys are opt-in: fault=inject added")
        out.append("fault=inject")
    return out


def _retire(key: str, value, retired: Retired) -> None:
    why = retired.refuse(value)
    if why is not None:
        raise ConfigError(f"{key}={value!r}: {why}")
    said = f"psrpc: {key} is retired: {retired.now}"
    env_value = _env_value(value)
    if retired.env and env_value is not None:
        os.environ[retired.env] = env_value  # this process and the ranks it starts
        said += f"; {retired.env}={env_value} set for this run"
    log.warning("%s (CHANGELOG.md)", said)
