"""psrpc: parameter-server training on torch.distributed.rpc.

Entry points: `python -m psrpc [overrides]`, `torchrun ... -m psrpc [overrides]`, and Hydra
multirun (`python -m psrpc -m ...`). See README.md and DESIGN's contracts.
"""

__version__ = "0.1.0"
