"""psrpc: parameter-server training on torch.distributed.rpc.

Entry points: `python -m psrpc [overrides]`, `torchrun ... -m psrpc [overrides]`, and Hydra
multirun (`python -m psrpc -m ...`). See README.md and docs/.

From Python: `psrpc.train(overrides, model=..., data=...)` (psrpc/api.py).

Importing psrpc changes nothing in the importing program (no logging setup, no environment).
"""

import os
from contextlib import contextmanager

__version__ = "0.1.0"

# Environment for psrpc's own processes, read when torch loads (set by the CLI before it imports
# torch, and given to the local launcher's forkserver):
# - TensorPipe logs every closed pipe at WARNING from C++ when a peer dies or leaves: noise on
#   paths psrpc handles; TORCH_CPP_LOG_LEVEL=WARNING brings them back.
# - Transparent huge pages for torch's CPU allocations: a fresh 45 MB receive buffer costs 6 ms
#   instead of 22 ms of page faults (benchmarks/README.md).
ENV_DEFAULTS = {"TORCH_CPP_LOG_LEVEL": "ERROR", "THP_MEM_ALLOC_ENABLE": "1"}


def apply_env_defaults() -> None:
    """In a process psrpc owns (the CLI, a rank): the defaults, unless the user set them."""
    for key, value in ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)


@contextmanager
def env_defaults():
    """The defaults for processes started inside this block; the caller's environment after."""
    saved = {k: os.environ.get(k) for k in ENV_DEFAULTS}
    apply_env_defaults()
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def __getattr__(name: str):
    """`psrpc.train` and `psrpc.compose`, imported on first use (importing psrpc stays light)."""
    if name in ("train", "compose"):
        from psrpc import api

        return getattr(api, name)
    raise AttributeError(f"module 'psrpc' has no attribute {name!r}")
