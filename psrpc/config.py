"""Typed config schemas (registered with Hydra's ConfigStore) and the checks Hydra cannot do.

Values live in `conf/` (YAML); this module holds the types and a one-line docstring per field.
Hydra rejects unknown keys and values of the wrong type; `validate` rejects values out of range
or inconsistent with each other, naming the key, the value and what is allowed.
"""

from __future__ import annotations

import inspect
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Optional

from omegaconf import MISSING, DictConfig, OmegaConf

from psrpc.cluster.wire import WIRE_DTYPE_NAMES
from psrpc.errors import ConfigError


@dataclass
class ClusterConfig:
    num_ps: int = MISSING
    """P: parameter-server processes (ranks 0..P-1)."""
    num_workers: int = MISSING
    """W: worker processes (ranks P..P+W-1); worker0 is the chief."""
    max_shard_bytes: int = MISSING
    """A tensor larger than this many bytes is split along dim 0 across PS."""
    bucket_bytes: int = MISSING
    """Fast path: shards are buckets of about this size, pushed as backward fills them; 0: one
    shard per PS."""
    worker_threads: Optional[int] = MISSING
    """torch threads per worker; null: this node's cores divided among its workers."""
    ps_threads: int = MISSING
    """torch threads per PS (the optimizer step on a flat buffer needs few)."""
    rpc_threads: int = MISSING
    """TensorPipe RPC threads per process (a worker waiting at a barrier holds none)."""
    rpc_timeout_s: Optional[float] = MISSING
    """Per-call RPC timeout; null: update.timeout_s + 60 (calls parked at a barrier count)."""
    init_timeout_s: float = MISSING
    """How long ranks wait for each other at start-up, and workers for the chief's init."""
    transports: Optional[list[str]] = MISSING
    """TensorPipe transports; ["uv"] halves an idle PS's CPU use; null: TensorPipe's default."""
    port: Optional[int] = MISSING
    """Local launcher's rendezvous port; null: MASTER_PORT if set, else a free one."""
    shm: str = MISSING
    """auto/on: a worker and a PS on the same host exchange dense gradients (and, in sync
    training, parameters) through shared memory; off: always TCP."""
    max_worker_restarts: int = MISSING
    """Local launcher: times each worker that dies is started again and rejoins the running
    job (data parallel; a new membership epoch, nobody restores a checkpoint); 0: lost."""
    max_ps_restarts: int = MISSING
    """Local launcher: times a PS that dies is started again (every shard rolls back to the
    last committed checkpoint), and the whole group when the chief dies; needs checkpoint.dir."""
    interface: Optional[str] = MISSING
    """NIC RPC listens on under torchrun; null: TP_SOCKET_IFNAME's, else the host name's."""


@dataclass
class SyncUpdateConfig:
    name: str = "sync"
    """Barrier aggregator: one update per round of gradients (large-batch SGD)."""
    replicas_to_aggregate: Optional[int] = MISSING
    """Gradients per round; null: W. Fewer than W makes the rest backup workers."""
    timeout_s: float = MISSING
    """A round waiting longer aggregates what it has; missing workers count as lost."""
    wire_dtype: str = MISSING
    """What crosses the wire: float32, bfloat16 or float16 (the master copy stays float32)."""


@dataclass
class AsyncUpdateConfig:
    name: str = "async"
    """Apply each gradient on arrival under the shard's lock."""
    max_staleness: Optional[int] = MISSING
    """Bounded staleness k: a worker too far ahead waits; null: unbounded."""
    staleness_lr: bool = MISSING
    """Divide the learning rate by (staleness + 1) for each applied gradient."""
    timeout_s: float = MISSING
    """A push held by the staleness bound longer than this is released; the laggard counts as lost."""
    wire_dtype: str = MISSING
    """What crosses the wire: float32, bfloat16 or float16 (the master copy stays float32)."""


@dataclass
class DataParallelConfig:
    name: str = "data"
    """Each worker holds the whole model and takes its slice of the global batch."""


@dataclass
class ModelParallelConfig:
    name: str = "model"
    """The model is cut into consecutive stages, one per worker of a pipeline replica."""
    stages: int = MISSING
    """Stages per pipeline replica; W must be a multiple of it."""
    microbatches: int = MISSING
    """Micro-batches per step; must divide train.batch_size."""
    split: Optional[list[int]] = MISSING
    """Cut points (indices of the first layer of stages 1..S-1); null: balanced by parameters."""


@dataclass
class OptimConfig:
    """What every optimizer has: the learning rate and its schedule (applied on the PS, by
    global step)."""

    name: str = MISSING
    lr: float = MISSING
    """Learning rate (the peak, with a schedule)."""
    weight_decay: float = MISSING
    """L2 penalty added to the gradient."""
    schedule: str = MISSING
    """constant, step (× gamma every step_size steps), cosine or linear (decay to min_lr at
    train.steps)."""
    warmup_steps: int = MISSING
    """Linear warmup from lr/warmup_steps to lr over the first steps (0: none)."""
    step_size: int = MISSING
    """schedule=step: steps between decays."""
    gamma: float = MISSING
    """schedule=step: the factor of each decay."""
    min_lr: float = MISSING
    """schedule=cosine/linear: the learning rate at train.steps."""


@dataclass
class SGDConfig(OptimConfig):
    name: str = "sgd"
    """torch.optim.SGD on the PS's flat master copy."""
    momentum: float = MISSING
    """Momentum (0: plain SGD)."""
    nesterov: bool = MISSING
    """Nesterov momentum."""


@dataclass
class AdamConfig(OptimConfig):
    name: str = "adam"
    """torch.optim.Adam on the PS's flat master copy."""
    betas: list[float] = MISSING
    """Coefficients of the running averages of the gradient and its square."""
    eps: float = MISSING
    """Added to the denominator for stability."""


@dataclass
class SparseConfig:
    """Embedding tables (psrpc.sparse.EmbeddingTables in the model): where their rows live and
    how the PS updates them."""

    partition: str = MISSING
    """How rows are spread over the PS: mod (row r on ps r % P) or div (contiguous ranges)."""
    optimizer: str = MISSING
    """Row-sparse optimizer on the PS: sgd, adagrad (row-wise, FBGEMM's) or adam (lazy)."""
    lr: float = MISSING
    """Learning rate of the tables (optim.schedule scales it too)."""
    eps: float = MISSING
    """adagrad / adam: added to the denominator."""
    weight_decay: float = MISSING
    """sgd / adagrad: L2 penalty on the touched rows."""
    betas: list[float] = MISSING
    """adam: coefficients of the moments."""


@dataclass
class TrainConfig:
    steps: int = MISSING
    """Global steps (sync: rounds; async: applied pushes)."""
    batch_size: int = MISSING
    """Per worker (data parallel) or per pipeline replica (model parallel)."""
    seed: int = MISSING
    """Seeds the model init, the synthetic data and the sample order."""
    device: str = MISSING
    """auto (CUDA when present), cpu or cuda."""
    tf32: Optional[bool] = MISSING
    """CUDA: TF32 in matmuls and cuDNN (true), neither (false), null: torch's default (cuDNN)."""
    log_every: int = MISSING
    """Global steps between progress lines and metrics.jsonl records."""
    warmup_steps: int = MISSING
    """samples_per_s counts from the end of this global step to the end."""
    eval_batch_size: int = MISSING
    """Batch size of the chief's final test-set evaluation."""
    nonfinite_patience: int = MISSING
    """Non-finite gradients in a row from one replica (each one skipped) that stop the run
    with an error; 0: never stop."""
    eval_every: int = MISSING
    """Global steps between evaluations of the master weights on the test split (into
    metrics.jsonl and TensorBoard); 0: only at the end."""
    amp: str = MISSING
    """Mixed precision on the workers: none, or bf16 (torch.autocast; the PS stays float32)."""
    clip_grad_norm: Optional[float] = MISSING
    """Clip each worker's gradient to this L2 norm before it is pushed (the norm of that
    worker's own gradient, not of the round's average); null: no clipping."""


@dataclass
class CheckpointConfig:
    dir: Optional[str] = MISSING
    """Checkpoint folder; restore is automatic when it holds one; null: no checkpoints."""
    every_steps: int = MISSING
    """Save every this many global steps (0: off)."""
    every_s: float = MISSING
    """Save when this many seconds passed since the last save (0: off)."""
    keep: int = MISSING
    """Newest checkpoints kept."""
    best: bool = MISSING
    """Keep the model with the best test metric (at each evaluation) in dir/best/, apart from
    the rolling checkpoints."""


@dataclass
class FaultConfig:
    slow_worker: Optional[int] = MISSING
    """Index of a worker that sleeps fault.slow_s before every push; null: none."""
    slow_s: float = MISSING
    """Seconds the slow worker sleeps each step."""
    crash_role: Optional[str] = MISSING
    """ps or worker: which kind of process kills itself (SIGKILL); null: none."""
    crash_index: int = MISSING
    """Index of the process that crashes (ps{k} or worker{i})."""
    crash_at_step: int = MISSING
    """Global step at which it crashes (first attempt of a torchrun group only)."""
    nan_worker: Optional[int] = MISSING
    """Index of a worker that pushes NaN gradients once; null: none."""
    nan_at_step: int = MISSING
    """Global step at which it does."""


@dataclass
class Config:
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    update: Any = MISSING
    """Group: sync | async."""
    parallel: Any = MISSING
    """Group: data | model."""
    model: Dict[str, Any] = MISSING
    """Group: mlp | cnn | resnet18 | custom; a factory by import path (`_target_`) and its
    arguments."""
    data: Dict[str, Any] = MISSING
    """Group: synthetic | mnist | cifar10 | custom; a dataset factory by import path and its
    arguments, plus `num_workers` (loader processes per worker)."""
    loss: Dict[str, Any] = MISSING
    """Group: cross_entropy | mse | bce | custom; loss(output, target), a batch mean."""
    metric: Dict[str, Any] = MISSING
    """Group: accuracy | mse | auc | custom; the test metric (summary: test_<name>)."""
    optim: Any = MISSING
    """Group: sgd | adam."""
    sparse: SparseConfig = field(default_factory=SparseConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    hooks: list[Any] = field(default_factory=list)
    """Extra chief hooks: [{_target_: my.module.MyHook, ...}] (hydra.utils.instantiate)."""
    out_dir: Optional[str] = MISSING
    """Where the chief writes its outputs; null: Hydra's job output directory."""


def register_configs() -> None:
    """Register the schemas: `conf/config.yaml` and each group's YAML extend them."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="psrpc_schema", node=Config)
    # Under schema/ so that they do not show up as options of the groups themselves.
    for group, name, node in [
        ("update", "sync", SyncUpdateConfig),
        ("update", "async", AsyncUpdateConfig),
        ("parallel", "data", DataParallelConfig),
        ("parallel", "model", ModelParallelConfig),
        ("optim", "sgd", SGDConfig),
        ("optim", "adam", AdamConfig),
    ]:
        cs.store(group=f"schema/{group}", name=name, node=node)


def to_config(cfg: DictConfig) -> Config:
    """Hydra's config as plain typed objects (dataclasses): what crosses process boundaries."""
    return OmegaConf.to_object(cfg)


AMP_DTYPES = {"none": None, "bf16": "bfloat16"}  # train.amp -> autocast dtype
# TensorPipe's transports in torch 2.x (its agent raises "Unknown transport" for any other name):
# TCP via libuv, shared memory on one host, InfiniBand verbs (needs an IB device).
TRANSPORTS = ("uv", "shm", "ibv")


def _check(ok: bool, key: str, value, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r}: {allowed}")


def _finite(x: float, least: float = 0.0) -> bool:
    """A real number ≥ `least` (NaN fails every comparison; inf is no timeout or rate)."""
    return math.isfinite(x) and x >= least


def validate(cfg: Config) -> None:
    """Reject values out of range or inconsistent; every message names key, value and what is allowed."""
    c, t, u, p = cfg.cluster, cfg.train, cfg.update, cfg.parallel
    _check(c.num_ps >= 1, "cluster.num_ps", c.num_ps, "need at least 1 parameter server")
    _check(c.num_workers >= 1, "cluster.num_workers", c.num_workers, "need at least 1 worker")
    _check(c.max_shard_bytes >= 1, "cluster.max_shard_bytes", c.max_shard_bytes, "must be ≥ 1")
    _check(c.bucket_bytes >= 0, "cluster.bucket_bytes", c.bucket_bytes,
           "must be ≥ 0 (0: one shard per PS)")
    _check(c.worker_threads is None or c.worker_threads >= 1, "cluster.worker_threads",
           c.worker_threads, "must be ≥ 1 or null (automatic)")
    _check(c.ps_threads >= 1, "cluster.ps_threads", c.ps_threads, "must be ≥ 1")
    _check(c.rpc_threads >= 2, "cluster.rpc_threads", c.rpc_threads, "must be ≥ 2")
    _check(c.shm in ("auto", "on", "off"), "cluster.shm", c.shm, "must be auto, on or off")
    _check(c.max_worker_restarts >= 0, "cluster.max_worker_restarts", c.max_worker_restarts,
           "must be ≥ 0 (0: a worker that dies is lost)")
    _check(c.max_ps_restarts >= 0, "cluster.max_ps_restarts", c.max_ps_restarts,
           "must be ≥ 0 (0: a PS or chief that dies ends the run)")
    _check(_finite(c.init_timeout_s) and c.init_timeout_s > 0, "cluster.init_timeout_s",
           c.init_timeout_s, "must be a finite number of seconds > 0")
    _check(c.port is None or 0 < c.port < 65536, "cluster.port", c.port,
           "must be a TCP port in 1..65535, or null")
    _check(c.transports is None or (c.transports and set(c.transports) <= set(TRANSPORTS)),
           "cluster.transports", c.transports,
           f"must list TensorPipe transports from {list(TRANSPORTS)}, or be null (its default)")
    if c.interface is not None:
        from psrpc.cluster import netif

        netif.check_interface(c.interface, "cluster.interface")
    if p.name == "model":
        _check(p.stages >= 1, "parallel.stages", p.stages, "must be ≥ 1")
        _check(c.num_workers % p.stages == 0, "cluster.num_workers", c.num_workers,
               f"must be a multiple of parallel.stages={p.stages} (W = replicas × stages)")
        _check(p.microbatches >= 1 and t.batch_size % p.microbatches == 0,
               "parallel.microbatches", p.microbatches,
               f"must be ≥ 1 and divide train.batch_size={t.batch_size}")
    _check(_finite(u.timeout_s) and u.timeout_s > 0, "update.timeout_s", u.timeout_s,
           "must be a finite number of seconds > 0 (every wait has a timeout)")
    _check(c.rpc_timeout_s is None or (_finite(c.rpc_timeout_s) and c.rpc_timeout_s > u.timeout_s),
           "cluster.rpc_timeout_s",
           c.rpc_timeout_s, f"must exceed update.timeout_s={u.timeout_s} (calls wait at the "
           "barrier that long), or be null")
    _check(u.wire_dtype in WIRE_DTYPE_NAMES, "update.wire_dtype", u.wire_dtype,
           f"must be one of {list(WIRE_DTYPE_NAMES)}")
    if u.name == "sync":
        r = u.replicas_to_aggregate
        _check(r is None or 1 <= r <= replicas(cfg), "update.replicas_to_aggregate", r,
               f"must be in 1..{replicas(cfg)} (the number of replicas), or null for all")
    else:
        _check(u.max_staleness is None or u.max_staleness >= 0, "update.max_staleness",
               u.max_staleness, "must be ≥ 0, or null for unbounded")
    _check(t.steps >= 1, "train.steps", t.steps, "must be ≥ 1")
    _check(t.batch_size >= 1, "train.batch_size", t.batch_size, "must be ≥ 1")
    _check(t.log_every >= 1, "train.log_every", t.log_every, "must be ≥ 1")
    _check(t.warmup_steps >= 0, "train.warmup_steps", t.warmup_steps, "must be ≥ 0")
    _check(t.nonfinite_patience >= 0, "train.nonfinite_patience", t.nonfinite_patience,
           "must be ≥ 0 (0: never stop)")
    _check(t.eval_batch_size >= 1, "train.eval_batch_size", t.eval_batch_size, "must be ≥ 1")
    _check(t.eval_every >= 0, "train.eval_every", t.eval_every, "must be ≥ 0 (0: only at the end)")
    _check(t.amp in AMP_DTYPES, "train.amp", t.amp, f"must be one of {list(AMP_DTYPES)}")
    _check(t.clip_grad_norm is None or _finite(t.clip_grad_norm) and t.clip_grad_norm > 0,
           "train.clip_grad_norm", t.clip_grad_norm, "must be a number > 0, or null")
    _check(t.device in ("auto", "cpu", "cuda"), "train.device", t.device,
           "must be auto, cpu or cuda")
    if t.device == "cuda":
        import torch

        _check(torch.cuda.is_available(), "train.device", t.device,
               "CUDA is not available on this machine; use auto (CUDA when present) or cpu")
    ck = cfg.checkpoint
    _check(ck.every_steps >= 0, "checkpoint.every_steps", ck.every_steps, "must be ≥ 0")
    _check(_finite(ck.every_s), "checkpoint.every_s", ck.every_s, "must be a finite number ≥ 0")
    _check(ck.keep >= 1, "checkpoint.keep", ck.keep, "must be ≥ 1")
    if not ck.dir:  # nothing would be saved: say so rather than train without checkpoints
        _check(ck.every_steps == 0, "checkpoint.every_steps", ck.every_steps,
               "needs checkpoint.dir (where to save), or 0")
        _check(ck.every_s == 0, "checkpoint.every_s", ck.every_s,
               "needs checkpoint.dir (where to save), or 0")
        _check(not ck.best, "checkpoint.best", ck.best,
               "needs checkpoint.dir (best/ goes there), or false")
    f = cfg.fault
    _check(f.slow_worker is None or 0 <= f.slow_worker < c.num_workers, "fault.slow_worker",
           f.slow_worker, f"must be a worker index in 0..{c.num_workers - 1}, or null")
    _check(_finite(f.slow_s), "fault.slow_s", f.slow_s, "must be a finite number of seconds ≥ 0")
    _check(f.crash_role in (None, "ps", "worker"), "fault.crash_role", f.crash_role,
           "must be ps, worker or null")
    if f.crash_role is not None:
        n = c.num_ps if f.crash_role == "ps" else c.num_workers
        _check(0 <= f.crash_index < n, "fault.crash_index", f.crash_index,
               f"must be a {f.crash_role} index in 0..{n - 1}")
        _check(0 <= f.crash_at_step < t.steps, "fault.crash_at_step", f.crash_at_step,
               f"must be a step in 0..{t.steps - 1} (train.steps={t.steps}), or it never happens")
    _check(f.nan_worker is None or 0 <= f.nan_worker < c.num_workers, "fault.nan_worker",
           f.nan_worker, f"must be a worker index in 0..{c.num_workers - 1}, or null")
    if f.nan_worker is not None:
        _check(0 <= f.nan_at_step < t.steps, "fault.nan_at_step", f.nan_at_step,
               f"must be a step in 0..{t.steps - 1} (train.steps={t.steps}), or it never happens")
    _validate_optim(cfg.optim)
    _validate_sparse(cfg.sparse)
    _validate_hooks(cfg.hooks)
    _validate_factories(cfg)


def _validate_optim(o) -> None:
    """What torch.optim would refuse on the PS, and values that can only diverge or mislead."""
    _check(_finite(o.lr), "optim.lr", o.lr, "must be a finite number ≥ 0")
    _check(_finite(o.weight_decay), "optim.weight_decay", o.weight_decay,
           "must be a finite number ≥ 0")
    if o.name == "sgd":
        # momentum ≥ 1 never forgets a gradient: the step grows without bound
        _check(_finite(o.momentum) and o.momentum < 1, "optim.momentum", o.momentum,
               "must be in [0, 1)")
        # torch's SGD: Nesterov needs momentum > 0 and no dampening (psrpc has no dampening)
        _check(not o.nesterov or o.momentum > 0, "optim.nesterov", o.nesterov,
               f"needs optim.momentum > 0 (it is {o.momentum})")
    elif o.name == "adam":
        _check(len(o.betas) == 2 and all(_finite(b) and b < 1 for b in o.betas), "optim.betas",
               list(o.betas), "must be two numbers in [0, 1)")
        _check(_finite(o.eps), "optim.eps", o.eps, "must be a finite number ≥ 0")
    from psrpc.ps.schedule import SCHEDULES

    _check(o.schedule in SCHEDULES, "optim.schedule", o.schedule,
           f"must be one of {sorted(SCHEDULES)}")
    _check(o.warmup_steps >= 0, "optim.warmup_steps", o.warmup_steps, "must be ≥ 0")
    _check(o.step_size >= 1, "optim.step_size", o.step_size, "must be ≥ 1")
    _check(_finite(o.gamma), "optim.gamma", o.gamma, "must be a finite number ≥ 0")
    _check(_finite(o.min_lr) and o.min_lr <= o.lr, "optim.min_lr", o.min_lr,
           f"must be in [0, optim.lr={o.lr}]")


def _validate_sparse(sp) -> None:
    from psrpc.sparse.optim import SPARSE_OPTIMIZERS
    from psrpc.sparse.rows import Partition

    _check(sp.partition in Partition.STRATEGIES, "sparse.partition", sp.partition,
           f"must be one of {list(Partition.STRATEGIES)}")
    _check(sp.optimizer in SPARSE_OPTIMIZERS, "sparse.optimizer", sp.optimizer,
           f"must be one of {sorted(SPARSE_OPTIMIZERS)}")
    _check(_finite(sp.lr), "sparse.lr", sp.lr, "must be a finite number ≥ 0")
    _check(_finite(sp.eps), "sparse.eps", sp.eps, "must be a finite number ≥ 0")
    _check(_finite(sp.weight_decay), "sparse.weight_decay", sp.weight_decay,
           "must be a finite number ≥ 0")
    _check(len(sp.betas) == 2 and all(_finite(b) and b < 1 for b in sp.betas), "sparse.betas",
           list(sp.betas), "must be two numbers in [0, 1)")


_HYDRA_KEYS = {"_target_", "_args_", "_recursive_", "_convert_", "_partial_"}


def _validate_hooks(hooks: list) -> None:
    """Every hook's `_target_` imports and takes the given arguments; nothing is built here (the
    chief builds them, after the cluster is up)."""
    from hydra._internal.utils import _locate  # what hydra.utils.instantiate imports with

    for i, spec in enumerate(hooks):
        key = f"hooks[{i}]"
        target = spec.get("_target_") if isinstance(spec, dict) else None
        _check(isinstance(target, str), key, spec,
               "must be a mapping with _target_: an import path, e.g. psrpc.hooks.StopAtStep")
        try:
            obj = _locate(target)
        except Exception as e:  # ImportError from the module's own failure, or a bad path
            cause = e.__cause__ or e
            raise ConfigError(f"{key}._target_={target!r}: cannot import it "
                              f"({type(cause).__name__}: {cause})") from None
        _check(callable(obj), f"{key}._target_", target, "must name a class or a function")
        try:
            signature = inspect.signature(obj)
        except (TypeError, ValueError):  # a builtin without one: the chief will tell
            continue
        kwargs = {k: v for k, v in spec.items() if k not in _HYDRA_KEYS}
        bind = signature.bind_partial if spec.get("_partial_") else signature.bind
        try:
            bind(*spec.get("_args_", []), **kwargs)
        except TypeError as e:
            raise ConfigError(f"{key}: {target}{signature} does not take {kwargs} ({e})") from None


def _validate_factories(cfg: Config) -> None:
    """model, data, loss, metric: the targets import and the arguments fit (the full check,
    with data built and a batch through the model, is factories.check_run)."""
    from psrpc.factories import check_arguments

    for key in ("data", "model", "loss", "metric"):
        check_arguments(key, getattr(cfg, key))
    workers = cfg.data.get("num_workers", 0)
    _check(isinstance(workers, int) and workers >= 0, "data.num_workers", workers,
           "must be an int ≥ 0 (0: load in the worker's own process)")


def stages(cfg: Config) -> int:
    """Pipeline stages per replica: parallel.stages in model-parallel mode, else 1."""
    return cfg.parallel.stages if cfg.parallel.name == "model" else 1


def replicas(cfg: Config) -> int:
    """Data-parallel replicas: W in data-parallel mode, W / stages in model-parallel mode."""
    return cfg.cluster.num_workers // stages(cfg)


def rpc_timeout_s(cfg: Config) -> float:
    """Per-call RPC timeout: above update.timeout_s, since calls wait at the barrier."""
    if cfg.cluster.rpc_timeout_s is not None:
        return float(cfg.cluster.rpc_timeout_s)
    return float(cfg.update.timeout_s) + 60.0


def resolve_paths(cfg: Config, cwd: Optional[str] = None) -> None:
    """Make user paths absolute, so every rank reads the same files whatever its cwd."""
    base = Path(cwd or os.getcwd())
    for key in ("root", "path"):  # a dataset's files, by convention
        if isinstance(cfg.data.get(key), str):
            cfg.data[key] = str((base / os.path.expanduser(cfg.data[key])).resolve())
    if cfg.checkpoint.dir:
        cfg.checkpoint.dir = str((base / os.path.expanduser(cfg.checkpoint.dir)).resolve())
    if cfg.out_dir:
        cfg.out_dir = str((base / os.path.expanduser(cfg.out_dir)).resolve())
