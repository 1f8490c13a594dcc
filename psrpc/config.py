"""Typed config schemas, registered with Hydra's ConfigStore: the types and a one-line docstring
per field, no behaviour.

Values live in `conf/` (YAML). Hydra rejects unknown keys and values of the wrong type; the
checks Hydra cannot do (ranges, consistency, factories that import) are psrpc/validate.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf


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
    """torch threads per worker; null: this node's cores divided among its workers (set it
    where ranks of several runs or emulated hosts share the cores; exactness across runs needs
    the same count). The rest of the tuning is derived, or environment variables for
    benchmarks (psrpc/knobs.py)."""
    init_timeout_s: float = MISSING
    """How long ranks wait for each other at start-up, and workers for the chief's init."""
    ps_replicas: int = MISSING
    """k: every shard also lives on k further PS (other hosts first), kept equal to it update by
    update; a lost PS fails over to one without a roll back. 0: none."""
    ps_placement: str = MISSING
    """Under torchrun/srun: first (ranks 0..P-1 are the PS, on the first node) or spread (the
    first rank of each of the first P nodes is a PS)."""
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
    dense: str = MISSING
    """ps: dense parameters on the PS; allreduce: replicated on the workers, averaged by a
    process group among them (gloo / NCCL), their optimizer there; only tables on the PS."""
    host_push: str = MISSING
    """auto: the workers of a host whose indices fill an aligned block add their dense
    gradients on the host and one of them pushes the sum to each shard on another host,
    sharing the reply; on: also to a shard on their own host reached over TCP; off: every
    worker pushes its own."""


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
    # One meaning in async, so no key: dense parameters live on the PS (all-reduce is a
    # synchronous collective) and each gradient is applied on its own (a host's sum would wait
    # for the host's slowest worker).
    dense: ClassVar[str] = "ps"
    host_push: ClassVar[str] = "off"


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


OPTIMIZERS: dict[str, type] = {}  # optim=<name> -> its schema (with its defaults)


def optimizer(cls: type) -> type:
    """Register a dense optimizer: `optim=<name>` on the command line. One class is the whole
    entry: its fields (with their defaults and docstrings) are the keyword arguments of
    torch.optim.<torch_class> (the schedule's fields aside); the PS builds it from them
    (psrpc/optim/dense.py) and psrpc/validate.py checks the ones it knows by name."""
    OPTIMIZERS[cls.name] = cls
    return cls


@dataclass
class OptimConfig:
    """What every optimizer has: the learning rate and its schedule (applied on the PS, by
    global step). The schedule's fields are psrpc's; the others go to torch.optim."""

    torch_class: ClassVar[str]  # the torch.optim class the PS builds
    name: str = MISSING
    lr: float = 0.05
    """Learning rate (the peak, with a schedule)."""
    weight_decay: float = 0.0
    """L2 penalty added to the gradient (AdamW: decoupled, applied to the weights)."""
    schedule: str = "constant"
    """constant, step (× gamma every step_size steps), cosine or linear (decay to min_lr at
    train.steps)."""
    warmup_steps: int = 0
    """Linear warmup from lr/warmup_steps to lr over the first steps (0: none)."""
    step_size: int = 1000
    """schedule=step: steps between decays."""
    gamma: float = 0.1
    """schedule=step: the factor of each decay."""
    min_lr: float = 0.0
    """schedule=cosine/linear: the learning rate at train.steps."""


@optimizer
@dataclass
class SGDConfig(OptimConfig):
    torch_class: ClassVar[str] = "SGD"
    name: str = "sgd"
    """torch.optim.SGD on the PS's flat master copy."""
    momentum: float = 0.9
    """Momentum (0: plain SGD)."""
    nesterov: bool = False
    """Nesterov momentum."""


@optimizer
@dataclass
class AdamConfig(OptimConfig):
    torch_class: ClassVar[str] = "Adam"
    name: str = "adam"
    """torch.optim.Adam on the PS's flat master copy."""
    lr: float = 0.001
    """Learning rate (the peak, with a schedule)."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """Coefficients of the running averages of the gradient and its square."""
    eps: float = 1e-8
    """Added to the denominator for stability."""


@optimizer
@dataclass
class AdamWConfig(AdamConfig):
    torch_class: ClassVar[str] = "AdamW"
    name: str = "adamw"
    """torch.optim.AdamW on the PS's flat master copy: Adam with decoupled weight decay."""
    weight_decay: float = 0.01
    """Decoupled weight decay: the weights shrink by lr × weight_decay each step."""


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
    cache_rows: int = MISSING
    """Hot-row cache: rows of each table a worker keeps (0: no cache; see pull_ahead)."""
    cache_staleness: int = MISSING
    """Hot-row cache: the most steps a cached row's value, or a gradient held for it, may lag
    the PS (0: no cache, every step pulls and pushes every row it touches)."""
    pull_ahead: str = MISSING
    """auto: with update.dense=allreduce in sync and sparse.cache_staleness >= 1 each step is
    computed while the last one's round runs, on table rows a step old, whatever cache_rows is
    (so cache_rows=0 is then not the exact run); on: that, an error where it cannot; off: never
    (cache_rows=0 is then the exact run bit for bit)."""
    cache_writes: str = MISSING
    """Hot-row cache: through (the default; write-through: every gradient pushed in its own
    step, only reads are cached) or hold (write-back: a cached row's gradients are summed on
    the worker and pushed at most cache_staleness steps late; fewer bytes on skewed ids, but
    row-wise Adagrad sees a summed step: MovieLens loses AUC)."""
    dynamic: bool = MISSING
    """Every table dynamic: raw int64 ids, a row per id made on first training (as
    TableSpec(dynamic=True) does for one table)."""
    hash_size: Optional[int] = MISSING
    """Every table hashed: raw ids folded into this many rows (null: as the model says)."""
    admit_after: int = MISSING
    """Dynamic tables: an id gets a row once seen this many times (1: at once)."""
    evict: str = MISSING
    """Dynamic tables: none, ttl (ids not trained on for ttl_steps steps) or lfu (at most
    max_rows rows per table, the least often seen dropped)."""
    ttl_steps: int = MISSING
    """Dynamic tables, evict=ttl: steps without training after which an id is dropped."""
    max_rows: Optional[int] = MISSING
    """Dynamic tables, evict=lfu: the most rows a table keeps (over all PS)."""


@dataclass
class TrainConfig:
    steps: int = MISSING
    """Global steps (sync: rounds; async: applied pushes)."""
    batch_size: int = MISSING
    """Per worker (data parallel) or per pipeline replica (model parallel)."""
    accumulate: int = MISSING
    """Data parallel: each worker's batch in this many micro-batches, forward and backward one
    after another, gradients summed before the push (memory of one micro-batch; the same
    update). 1: the whole batch at once."""
    seed: int = MISSING
    """Seeds the model init, the synthetic data and the sample order."""
    shuffle: bool = MISSING
    """A new order of the training set every epoch (false: the dataset's own order, as a log
    replayed in time)."""
    device: str = MISSING
    """auto (CUDA when present), cpu or cuda."""
    tf32: Optional[bool] = MISSING
    """CUDA: TF32 in matmuls and cuDNN (true), neither (false), null: torch's default (cuDNN)."""
    log_every: int = MISSING
    """Global steps between progress lines and metrics.jsonl records."""
    untimed_steps: int = MISSING
    """samples_per_s counts from the end of this global step to the end (the steps before
    it warm caches and allocators up; was train.untimed_steps)."""
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
    """Opt in with `fault=inject`; without it nothing is injected (FaultConfig() is that)."""

    slow_worker: Optional[int] = None
    """Index of a worker that sleeps fault.slow_s before every push; null: none."""
    slow_s: float = 0.0
    """Seconds the slow worker sleeps each step."""
    crash_role: Optional[str] = None
    """ps or worker: which kind of process kills itself (SIGKILL); null: none."""
    crash_index: int = 0
    """Index of the process that crashes (ps{k} or worker{i})."""
    crash_at_step: int = 0
    """Global step at which it crashes (first attempt of a torchrun group only)."""
    crash_point: str = "after_update"
    """Where: after_update (once the step is applied), or between_backups (a PS with
    cluster.ps_replicas >= 2: after sending the update to its first backup, before the next)."""
    nan_worker: Optional[int] = None
    """Index of a worker that pushes NaN gradients once; null: none."""
    nan_at_step: int = 0
    """Global step at which it does."""


@dataclass
class Config:
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """Processes and how they reach each other: PS and workers, replicas, restarts, transport."""
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
    """Group: sgd | adam | adamw (psrpc/config.py's OPTIMIZERS)."""
    sparse: SparseConfig = field(default_factory=SparseConfig)
    """Embedding tables: where their rows live, how the PS updates them, the workers' caches."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """The training loop: steps, batch, seed, device, logging and evaluation."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Step-consistent checkpoints of every shard, and the automatic restore from them."""
    fault: Optional[FaultConfig] = None
    """Group: none | inject. Faults injected on purpose (tests, benchmarks, drills): a slow
    worker, a crash, a NaN; `fault=inject` makes the keys."""
    hooks: list[Any] = field(default_factory=list)
    """Extra chief hooks: [{_target_: my.module.MyHook, ...}] (hydra.utils.instantiate)."""
    out_dir: Optional[str] = MISSING
    """Where the chief writes its outputs; null: Hydra's job output directory."""


def register_configs() -> None:
    """Register the schemas: `conf/config.yaml` and each group's YAML extend them; each
    optimizer is a group option of its own (`optim=<name>`, its defaults in its class)."""
    cs = ConfigStore.instance()
    cs.store(name="psrpc_schema", node=Config)
    # Under schema/ so that they do not show up as options of the groups themselves.
    for group, name, node in [
        ("update", "sync", SyncUpdateConfig),
        ("update", "async", AsyncUpdateConfig),
        ("parallel", "data", DataParallelConfig),
        ("parallel", "model", ModelParallelConfig),
    ]:
        cs.store(group=f"schema/{group}", name=name, node=node)
    for name, node in OPTIMIZERS.items():
        cs.store(group="optim", name=name, node=node)
    cs.store(group="fault", name="inject", node=FaultConfig)


def to_config(cfg: DictConfig) -> Config:
    """Hydra's config as plain typed objects (dataclasses): what crosses process boundaries.
    Without `fault=inject`, `fault` is FaultConfig() (nothing injected), never None."""
    out = OmegaConf.to_object(cfg)
    if out.fault is None:
        out.fault = FaultConfig()
    return out
