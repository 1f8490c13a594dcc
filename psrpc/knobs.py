"""Knobs a user should never need, kept for benchmarks, emulated hosts and drills: environment
variables, read where they are used, not config keys. Unset, each has psrpc's choice.

    PSRPC_RPC_TIMEOUT_S     per-call RPC timeout (default: update.timeout_s + 60, since calls
                            wait at the barrier); must exceed update.timeout_s
    PSRPC_RPC_THREADS       TensorPipe RPC threads per process (default 16; ≥ 2)
    PSRPC_PS_THREADS        torch threads per PS (default 1: its optimizer step is one flat op)
    PSRPC_TP_TRANSPORTS     TensorPipe transports, comma-separated (default uv: an idle PS burns
                            half the CPU it does on TensorPipe's default list)
    PSRPC_TP_CHANNELS       TensorPipe channels, comma-separated (default cma,basic: mpt_uv cost
                            DLRM 1.7x in samples/s across hosts)

The local launcher's ranks inherit them; under torchrun or srun set them on every host.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Callable

from psrpc.errors import ConfigError

# TensorPipe's transports in torch 2.x (its agent raises "Unknown transport" for any other name):
# TCP via libuv, shared memory on one host, InfiniBand verbs (needs an IB device).
TRANSPORTS = ("uv", "shm", "ibv")
# TensorPipe's CPU channels, in its order of preference (psrpc/cluster/comm.py says why these).
CPU_CHANNELS = ("cma", "mpt_uv", "basic")


@dataclass(frozen=True)
class Knob:
    env: str
    default: str
    parse: Callable[[str], object]
    right: str  # what a good value is, for the error

    def get(self):
        raw = os.environ.get(self.env, self.default)
        try:
            return self.parse(raw)
        except ValueError:
            raise ConfigError(f"{self.env}={raw!r}: {self.right}") from None


def _int_at_least(least: int) -> Callable[[str], int]:
    def parse(raw: str) -> int:
        value = int(raw)
        if value < least:
            raise ValueError(raw)
        return value
    return parse


def _names_from(allowed: tuple) -> Callable[[str], list]:
    def parse(raw: str) -> list:
        names = [n.strip() for n in raw.split(",") if n.strip()]
        if not names or not set(names) <= set(allowed):
            raise ValueError(raw)
        return [n for n in allowed if n in names]  # TensorPipe's order of preference
    return parse


def _seconds(raw: str) -> float:
    value = float(raw)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(raw)
    return value


RPC_TIMEOUT_S = Knob("PSRPC_RPC_TIMEOUT_S", "", _seconds,
                     "must be a finite number of seconds > update.timeout_s, or unset")
RPC_THREADS = Knob("PSRPC_RPC_THREADS", "16", _int_at_least(2), "must be an integer ≥ 2")
PS_THREADS = Knob("PSRPC_PS_THREADS", "1", _int_at_least(1), "must be an integer ≥ 1")
TRANSPORTS_KNOB = Knob("PSRPC_TP_TRANSPORTS", "uv", _names_from(TRANSPORTS),
                       f"must list TensorPipe transports from {list(TRANSPORTS)}, comma-separated")
CHANNELS_KNOB = Knob("PSRPC_TP_CHANNELS", "cma,basic", _names_from(CPU_CHANNELS),
                     f"must list TensorPipe channels from {list(CPU_CHANNELS)}, comma-separated")
ALL = (RPC_TIMEOUT_S, RPC_THREADS, PS_THREADS, TRANSPORTS_KNOB, CHANNELS_KNOB)


def rpc_timeout_s(update_timeout_s: float) -> float:
    """Per-call RPC timeout: above update.timeout_s, since calls wait at the barrier."""
    if not os.environ.get(RPC_TIMEOUT_S.env):
        return float(update_timeout_s) + 60.0
    value = RPC_TIMEOUT_S.get()
    if value <= update_timeout_s:
        raise ConfigError(f"{RPC_TIMEOUT_S.env}={value:g}: must exceed update.timeout_s="
                          f"{update_timeout_s:g} (calls wait at the barrier that long), or be "
                          "unset")
    return value


def check(update_timeout_s: float) -> None:
    """Every knob set in the environment, read once: a bad one stops the start, naming it."""
    for knob in ALL[1:]:
        knob.get()
    rpc_timeout_s(update_timeout_s)


def given() -> dict[str, str]:
    """The knobs set in this environment."""
    return {k.env: os.environ[k.env] for k in ALL if os.environ.get(k.env)}


def adopt(tuning: dict[str, str]) -> None:
    """This process's knobs become exactly `tuning` (a launcher's `given()`)."""
    for knob in ALL:
        if knob.env in tuning:
            os.environ[knob.env] = tuning[knob.env]
        else:
            os.environ.pop(knob.env, None)
