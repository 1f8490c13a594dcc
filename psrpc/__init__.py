"""psrpc: parameter-server training on torch.distributed.rpc.

Entry points: `python -m psrpc [overrides]`, `torchrun ... -m psrpc [overrides]`, and Hydra
multirun (`python -m psrpc -m ...`). See README.md and DESIGN's contracts.
"""

import os

__version__ = "0.1.0"

# Read when torch loads, here or in the forkserver the local launcher starts (every entry point
# imports psrpc first):
# - TensorPipe logs every closed pipe at WARNING from C++ when a peer dies or leaves: noise on
#   paths psrpc handles; TORCH_CPP_LOG_LEVEL=WARNING brings them back.
# - Transparent huge pages for torch's CPU allocations: a fresh 45 MB receive buffer costs 6 ms
#   instead of 22 ms of page faults (benchmarks/README.md).
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
