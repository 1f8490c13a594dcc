"""psrpc: parameter-server training on torch.distributed.rpc.

Entry points: `python -m psrpc [overrides]`, `torchrun ... -m psrpc [overrides]`, and Hydra
multirun (`python -m psrpc -m ...`). See README.md and docs/.

From Python: `psrpc.train(overrides, model=..., data=...)` (psrpc/api.py).

Importing psrpc changes nothing in the importing program (no logging setup, no environment).
"""

__version__ = "0.2.0"


def __getattr__(name: str):
    """`psrpc.train` and `psrpc.compose`, imported on first use (importing psrpc stays light)."""
    if name in ("train", "compose"):
        from psrpc import api

        return getattr(api, name)
    raise AttributeError(f"module 'psrpc' has no attribute {name!r}")
