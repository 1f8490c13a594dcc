"""The dense optimizers over one flat tensor and the learning-rate schedule: what the PS runs on
its shards and, with `update.dense=allreduce`, what the workers run on their replicas. A leaf:
no RPC, PS or worker code."""

from psrpc.optim.dense import build_optimizer, count_step, step_scaled
from psrpc.optim.schedule import SCHEDULES, lr_factor

__all__ = ["SCHEDULES", "build_optimizer", "count_step", "lr_factor", "step_scaled"]
