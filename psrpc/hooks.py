"""Hooks on the chief, the users' extension point (as TensorFlow's SessionRunHook): the public
names. They live with the chief, in psrpc/session/hooks.py, which says how to write one."""

from psrpc.session.hooks import (BestModel, Evaluate, Hook, Hooks, MetricsLog, RunContext, StepInfo,
                                 StopAtStep, Throughput)

__all__ = ["BestModel", "Evaluate", "Hook", "Hooks", "MetricsLog", "RunContext", "StepInfo",
           "StopAtStep", "Throughput"]
