"""The environment psrpc's own processes run with (the CLI, every rank): set before torch loads,
never in a program that only imports psrpc."""

import os
from contextlib import contextmanager

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
