"""validate: every bad value is refused before any process starts, naming the key, the value and
what is allowed (the command line's one-line error is checked in test_cli.py)."""

import pytest

from psrpc.errors import ConfigError
from tests.conftest import compose


@pytest.mark.parametrize("overrides, message", [
    (["optim.lr=-0.1"], "optim.lr=-0.1: must be a finite number ≥ 0"),
    (["optim.lr=nan"], "optim.lr=nan: must be a finite number ≥ 0"),
    (["optim.momentum=-0.5"], "optim.momentum=-0.5: must be in [0, 1)"),
    (["optim.momentum=1.0"], "optim.momentum=1.0: must be in [0, 1)"),
    (["optim.weight_decay=-1e-4"], "optim.weight_decay=-0.0001: must be a finite number ≥ 0"),
    (["optim.momentum=0", "optim.nesterov=true"],
     "optim.nesterov=True: needs optim.momentum > 0 (it is 0.0)"),
    (["optim=adam", "optim.betas=[0.9,1.0]"],
     "optim.betas=[0.9, 1.0]: must be two numbers in [0, 1)"),
    (["optim=adam", "optim.betas=[-0.1,0.999]"], "optim.betas=[-0.1, 0.999]: must be two numbers"),
    (["optim=adam", "optim.betas=[0.9]"], "optim.betas=[0.9]: must be two numbers in [0, 1)"),
    (["optim=adam", "optim.eps=-1e-8"], "optim.eps=-1e-08: must be a finite number ≥ 0"),
    (["optim=adam", "optim.weight_decay=-1"], "optim.weight_decay=-1.0: must be a finite"),
    (["hooks=[{_target_: psrpc.hooks.NoSuchHook}]"],
     "hooks[0]._target_='psrpc.hooks.NoSuchHook': cannot import it"),
    (["hooks=[{_target_: psrpc.hooks}]"], "hooks[0]._target_='psrpc.hooks': must name a class"),
    (["hooks=[{_target_: psrpc.hooks.StopAtStep, last_stpe: 3}]"],
     "hooks[0]: psrpc.hooks.StopAtStep(last_step: 'int') does not take {'last_stpe': 3}"),
    (["hooks=[7]"], "hooks[0]=7: must be a mapping with _target_"),
    (["update.timeout_s=inf"], "update.timeout_s=inf: must be a finite number of seconds > 0"),
    (["cluster.init_timeout_s=0"], "cluster.init_timeout_s=0.0: must be a finite number"),
    (["checkpoint.every_steps=10"], "checkpoint.every_steps=10: needs checkpoint.dir"),
    (["checkpoint.every_s=5"], "checkpoint.every_s=5.0: needs checkpoint.dir"),
    (["fault.nan_worker=0", "fault.nan_at_step=500"],
     "fault.nan_at_step=500: must be a step in 0..499 (train.steps=500)"),
    (["fault.crash_role=ps", "fault.crash_at_step=-1"], "fault.crash_at_step=-1: must be a step"),
    (["fault.slow_worker=0", "fault.slow_s=-1"], "fault.slow_s=-1.0: must be a finite number"),
    (["sparse.eps=0"], "sparse.eps=0.0: must be a finite number > 0 (sparse.optimizer=adagrad"),
    (["sparse.optimizer=adam", "sparse.eps=0"], "sparse.eps=0.0: must be a finite number > 0"),
    (["sparse.optimizer=adam", "sparse.weight_decay=0.01"],
     "sparse.weight_decay=0.01: is not applied by sparse.optimizer=adam"),
    (["sparse.cache_writes=back"], "sparse.cache_writes='back': must be one of ['hold', 'through']"),
    (["sparse.pull_ahead=yes"], "sparse.pull_ahead='yes': must be one of ['auto', 'on', 'off']"),
    (["sparse.pull_ahead=on", "sparse.cache_staleness=1"],
     "sparse.pull_ahead='on': needs update=sync, update.dense=allreduce"),
    (["sparse.evict=lru"], "sparse.evict='lru': must be one of ['none', 'ttl', 'lfu']"),
    (["sparse.evict=lfu"], "sparse.max_rows=None: must be set (rows per table, over all PS)"),
    (["sparse.evict=ttl"], "sparse.ttl_steps=0: must be an integer ≥ 1 with sparse.evict=ttl"),
    (["sparse.admit_after=0"], "sparse.admit_after=0: must be an integer ≥ 1"),
    (["sparse.dynamic=true", "sparse.hash_size=100"],
     "sparse.hash_size=100: must be null with sparse.dynamic=true"),
    (["sparse.max_rows=-5"], "sparse.max_rows=-5: must be an integer ≥ 1, or null"),
    (["update.dense=nccl"], "update.dense='nccl': must be one of ['ps', 'allreduce']"),
    (["update=async", "update.dense=allreduce"], "update.dense='allreduce': needs update=sync"),
    (["update.dense=allreduce", "cluster.num_workers=3", "update.replicas_to_aggregate=2"],
     "update.replicas_to_aggregate=2: must be null (every worker) with update.dense=allreduce"),
    (["update.dense=allreduce", "update.wire_dtype=bfloat16"],
     "update.wire_dtype='bfloat16': must be float32 with update.dense=allreduce"),
])
def test_bad_value_names_key_value_and_what_is_allowed(overrides, message):
    with pytest.raises(ConfigError) as e:
        compose(overrides)
    assert message in str(e.value)


@pytest.mark.parametrize("overrides", [
    ["optim.lr=0"],  # allowed: a run that only measures
    ["optim.nesterov=true"],  # momentum 0.9 by default
    ["optim=adam", "optim.betas=[0.0,0.0]"],
    ["hooks=[{_target_: psrpc.hooks.StopAtStep, last_step: 3}]"],
    ["hooks=[{_target_: psrpc.hooks.StopAtStep, _partial_: true}]"],
    ["checkpoint.dir=ck", "checkpoint.every_steps=10", "checkpoint.every_s=5"],
    ["sparse.optimizer=sgd", "sparse.eps=0"],  # sgd divides by nothing
    ["sparse.optimizer=adagrad", "sparse.weight_decay=0.01"],
])
def test_good_values_pass(overrides):
    compose(overrides)


@pytest.mark.parametrize("env, message", [
    ({"PSRPC_TP_TRANSPORTS": ""}, "PSRPC_TP_TRANSPORTS='': must list TensorPipe transports from"),
    ({"PSRPC_TP_TRANSPORTS": "uv,tcp"}, "PSRPC_TP_TRANSPORTS='uv,tcp': must list TensorPipe"),
    ({"PSRPC_TP_CHANNELS": "tcp"}, "PSRPC_TP_CHANNELS='tcp': must list TensorPipe channels from "
                                   "['cma', 'mpt_uv', 'basic']"),
    ({"PSRPC_RPC_TIMEOUT_S": "inf"}, "PSRPC_RPC_TIMEOUT_S='inf': must be a finite number"),
    ({"PSRPC_RPC_TIMEOUT_S": "30"}, "PSRPC_RPC_TIMEOUT_S=30: must exceed update.timeout_s=60"),
    ({"PSRPC_RPC_THREADS": "1"}, "PSRPC_RPC_THREADS='1': must be an integer ≥ 2"),
    ({"PSRPC_PS_THREADS": "two"}, "PSRPC_PS_THREADS='two': must be an integer ≥ 1"),
])
def test_a_bad_knob_names_its_variable_and_what_is_allowed(monkeypatch, env, message):
    """The tuning left to environment variables (psrpc/knobs.py) is checked at the start as
    the keys are."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as e:
        compose([])
    assert message in str(e.value)


@pytest.mark.parametrize("env", [{"PSRPC_TP_TRANSPORTS": "uv,shm"}, {"PSRPC_RPC_TIMEOUT_S": "61"},
                                 {"PSRPC_TP_CHANNELS": "basic,cma,mpt_uv"}])
def test_good_knobs_pass(monkeypatch, env):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    compose([])
