"""Everything psrpc checks before a process starts, in one place: values in range and consistent
with each other (`check_values`), paths made absolute (`resolve_paths`), and what the user's
factories build (`check_run`: the targets import, their arguments fit, the data builds, a batch of
two goes through the model, the loss and the metric, the model cuts into its stages). Every message
names the key, the value and what would be right. The schema is psrpc/config.py.

    cfg = to_config(hydra_cfg); resolve_paths(cfg); check_values(cfg); check_run(cfg)
"""

from __future__ import annotations

import inspect
import math
import os
from pathlib import Path
from typing import Optional

import torch
from hydra._internal.utils import _locate  # what hydra.utils.instantiate imports with
from torch.utils.data import default_collate

from psrpc import knobs
from psrpc.cluster import netif
from psrpc.cluster.topology import replicas
from psrpc.cluster.wire import WIRE_DTYPE_NAMES
from psrpc.config import Config
from psrpc.errors import ConfigError, first_line, one_of, require
from psrpc.faults import check_faults
from psrpc.factories import (arguments, build_loss, build_metric, build_model, injected, load_data,
                             locate)
from psrpc.models.stages import model_cuts
from psrpc.optim.schedule import SCHEDULES
from psrpc.sparse.dynamic import EVICTIONS
from psrpc.sparse.optim import SPARSE_OPTIMIZERS
from psrpc.sparse.rows import Partition
from psrpc.sparse.tables import DryRows, find_tables
from psrpc.worker.replica import AMP_DTYPES


def _finite(x: float, least: float = 0.0) -> bool:
    """A real number ≥ `least` (NaN fails every comparison; inf is no timeout or rate)."""
    return math.isfinite(x) and x >= least


def check_values(cfg: Config) -> None:
    """Reject values out of range or inconsistent; every message names key, value and what is
    allowed. One group at a time, in this order; then the rules that cross groups."""
    for check in (_check_cluster, _check_parallel, _check_update, _check_train,
                  _check_checkpoint, check_faults):
        check(cfg)
    _validate_optim(cfg.optim)
    _validate_sparse(cfg.sparse)
    _check_across(cfg)
    _validate_hooks(cfg.hooks)
    _validate_factories(cfg)


def _check_cluster(cfg: Config) -> None:
    c, p = cfg.cluster, cfg.parallel
    require(c.num_ps >= 1, "cluster.num_ps", c.num_ps, "need at least 1 parameter server")
    require(c.num_workers >= 1, "cluster.num_workers", c.num_workers, "need at least 1 worker")
    require(c.max_shard_bytes >= 1, "cluster.max_shard_bytes", c.max_shard_bytes, "must be ≥ 1")
    require(c.bucket_bytes >= 0, "cluster.bucket_bytes", c.bucket_bytes,
           "must be ≥ 0 (0: one shard per PS)")
    require(c.worker_threads is None or c.worker_threads >= 1, "cluster.worker_threads",
           c.worker_threads, "must be ≥ 1 or null (automatic)")
    require(c.shm in ("auto", "on", "off"), "cluster.shm", c.shm, "must be auto, on or off")
    require(c.max_worker_restarts >= 0, "cluster.max_worker_restarts", c.max_worker_restarts,
           "must be ≥ 0 (0: a worker that dies is lost)")
    require(c.max_ps_restarts >= 0, "cluster.max_ps_restarts", c.max_ps_restarts,
           "must be ≥ 0 (0: a PS or chief that dies ends the run)")
    require(_finite(c.init_timeout_s) and c.init_timeout_s > 0, "cluster.init_timeout_s",
           c.init_timeout_s, "must be a finite number of seconds > 0")
    require(c.port is None or 0 < c.port < 65536, "cluster.port", c.port,
           "must be a TCP port in 1..65535, or null")
    one_of(("first", "spread"), c.ps_placement, "cluster.ps_placement")
    require(c.ps_placement == "first" or p.name == "data", "cluster.ps_placement",
            c.ps_placement, "spread is for parallel=data (pipeline stages find their devices "
            "from consecutive ranks)")
    require(type(c.ps_replicas) is int and 0 <= c.ps_replicas < c.num_ps, "cluster.ps_replicas",
            c.ps_replicas, f"must be an int in 0..num_ps-1 = {c.num_ps - 1} (backups on other PS)")
    require(c.ps_replicas == 0 or p.name == "data", "cluster.ps_replicas", c.ps_replicas,
            "replicas are for parallel=data (a lost pipeline stage is not recovered)")
    if c.interface is not None:
        netif.check_interface(c.interface, "cluster.interface")


def _check_parallel(cfg: Config) -> None:
    c, t, p = cfg.cluster, cfg.train, cfg.parallel
    if p.name != "model":
        return
    require(p.stages >= 1, "parallel.stages", p.stages, "must be ≥ 1")
    require(c.num_workers % p.stages == 0, "cluster.num_workers", c.num_workers,
           f"must be a multiple of parallel.stages={p.stages} (W = replicas × stages)")
    require(p.microbatches >= 1 and t.batch_size % p.microbatches == 0,
           "parallel.microbatches", p.microbatches,
           f"must be ≥ 1 and divide train.batch_size={t.batch_size}")


def _check_update(cfg: Config) -> None:
    u, p = cfg.update, cfg.parallel
    require(_finite(u.timeout_s) and u.timeout_s > 0, "update.timeout_s", u.timeout_s,
           "must be a finite number of seconds > 0 (every wait has a timeout)")
    knobs.check(u.timeout_s)  # the environment's tuning (psrpc/knobs.py), if any
    one_of(WIRE_DTYPE_NAMES, u.wire_dtype, "update.wire_dtype")
    one_of(("ps", "allreduce"), u.dense, "update.dense")
    one_of(("auto", "on", "off"), u.host_push, "update.host_push")
    why = None if u.host_push != "on" else (  # (async has no such key: psrpc/keys.py)
        "is for parallel=data" if p.name != "data" else "is for update.dense=ps" if
        u.dense != "ps" else "needs every worker in each round, no backup workers" if
        u.replicas_to_aggregate not in (None, replicas(cfg)) else None)
    require(why is None, "update.host_push", "on", f"{why}; use auto or off")
    if u.name == "sync":
        r = u.replicas_to_aggregate
        require(r is None or 1 <= r <= replicas(cfg), "update.replicas_to_aggregate", r,
               f"must be in 1..{replicas(cfg)} (the number of replicas), or null for all")
    else:
        require(u.max_staleness is None or u.max_staleness >= 0, "update.max_staleness",
               u.max_staleness, "must be ≥ 0, or null for unbounded")
    if u.dense == "allreduce":  # (sync only: async has no such key, psrpc/keys.py)
        require(p.name == "data", "update.dense", u.dense,
                "is for parallel=data (pipeline stages keep their parameters on the PS)")
        require(u.replicas_to_aggregate in (None, replicas(cfg)),
                "update.replicas_to_aggregate", u.replicas_to_aggregate,
                "must be null (every worker) with update.dense=allreduce: an all-reduce has no "
                "backup workers")
        require(u.wire_dtype == "float32", "update.wire_dtype", u.wire_dtype,
                "must be float32 with update.dense=allreduce (the process group averages "
                "float32 gradients)")


def _check_train(cfg: Config) -> None:
    t, p = cfg.train, cfg.parallel
    require(t.steps >= 1, "train.steps", t.steps, "must be ≥ 1")
    require(t.batch_size >= 1, "train.batch_size", t.batch_size, "must be ≥ 1")
    require(t.accumulate >= 1 and t.batch_size % t.accumulate == 0, "train.accumulate",
            t.accumulate, f"must be ≥ 1 and divide train.batch_size={t.batch_size}")
    require(t.accumulate == 1 or p.name == "data", "train.accumulate", t.accumulate,
            "is for parallel=data; a pipeline splits its batch with parallel.microbatches")
    require(t.log_every >= 1, "train.log_every", t.log_every, "must be ≥ 1")
    require(t.untimed_steps >= 0, "train.untimed_steps", t.untimed_steps, "must be ≥ 0")
    require(t.nonfinite_patience >= 0, "train.nonfinite_patience", t.nonfinite_patience,
           "must be ≥ 0 (0: never stop)")
    require(t.eval_batch_size >= 1, "train.eval_batch_size", t.eval_batch_size, "must be ≥ 1")
    require(t.eval_every >= 0, "train.eval_every", t.eval_every, "must be ≥ 0 (0: only at the end)")
    one_of(AMP_DTYPES, t.amp, "train.amp")
    require(t.clip_grad_norm is None or _finite(t.clip_grad_norm) and t.clip_grad_norm > 0,
           "train.clip_grad_norm", t.clip_grad_norm, "must be a number > 0, or null")
    require(t.device in ("auto", "cpu", "cuda"), "train.device", t.device,
           "must be auto, cpu or cuda")
    if t.device == "cuda":
        require(torch.cuda.is_available(), "train.device", t.device,
               "CUDA is not available on this machine; use auto (CUDA when present) or cpu")


def _check_checkpoint(cfg: Config) -> None:
    ck = cfg.checkpoint
    require(ck.every_steps >= 0, "checkpoint.every_steps", ck.every_steps, "must be ≥ 0")
    require(_finite(ck.every_s), "checkpoint.every_s", ck.every_s, "must be a finite number ≥ 0")
    require(ck.keep >= 1, "checkpoint.keep", ck.keep, "must be ≥ 1")
    if not ck.dir:  # nothing would be saved: say so rather than train without checkpoints
        require(ck.every_steps == 0, "checkpoint.every_steps", ck.every_steps,
               "needs checkpoint.dir (where to save), or 0")
        require(ck.every_s == 0, "checkpoint.every_s", ck.every_s,
               "needs checkpoint.dir (where to save), or 0")
        require(not ck.best, "checkpoint.best", ck.best,
               "needs checkpoint.dir (best/ goes there), or false")


def _check_across(cfg: Config) -> None:
    """The rules between groups: the row cache and checkpoints, pulling ahead."""
    # A worker's row cache hands its held gradients over before each checkpoint step, which it
    # can only know when checkpoints come by steps.
    require(not (cfg.sparse.cache_rows and cfg.sparse.cache_staleness and cfg.checkpoint.dir
                 and cfg.checkpoint.every_s and cfg.sparse.cache_writes == "hold"),
            "checkpoint.every_s", cfg.checkpoint.every_s,
            "must be 0 with the hot-row cache (sparse.cache_rows and sparse.cache_staleness "
            "> 0): its held gradients go to the PS before each checkpoint step, known only "
            "with checkpoint.every_steps (or use sparse.cache_writes=through)")
    # Pulling ahead computes a step on rows one step old: a bound of one step or more, and the
    # dense replica on the workers (its update applied before the next forward), in sync
    require(cfg.sparse.pull_ahead != "on" or (
        cfg.update.name == "sync" and cfg.update.dense == "allreduce"
        and cfg.parallel.name == "data" and cfg.sparse.cache_staleness >= 1),
        "sparse.pull_ahead", "on", "needs update=sync, update.dense=allreduce, parallel=data "
        "and sparse.cache_staleness ≥ 1 (the rows of a step computed ahead are a step old)")


def _validate_optim(o) -> None:
    """What torch.optim would refuse on the PS, and values that can only diverge or mislead."""
    require(_finite(o.lr), "optim.lr", o.lr, "must be a finite number ≥ 0")
    require(_finite(o.weight_decay), "optim.weight_decay", o.weight_decay,
           "must be a finite number ≥ 0")
    if hasattr(o, "momentum"):  # (by field: an optimizer registered later is checked too)
        # momentum ≥ 1 never forgets a gradient: the step grows without bound
        require(_finite(o.momentum) and o.momentum < 1, "optim.momentum", o.momentum,
               "must be in [0, 1)")
        # torch's SGD: Nesterov needs momentum > 0 and no dampening (psrpc has no dampening)
        require(not o.nesterov or o.momentum > 0, "optim.nesterov", o.nesterov,
               f"needs optim.momentum > 0 (it is {o.momentum})")
    if hasattr(o, "betas"):
        require(len(o.betas) == 2 and all(_finite(b) and b < 1 for b in o.betas), "optim.betas",
               list(o.betas), "must be two numbers in [0, 1)")
    if hasattr(o, "eps"):
        require(_finite(o.eps), "optim.eps", o.eps, "must be a finite number ≥ 0")
    one_of(SCHEDULES, o.schedule, "optim.schedule")
    require(o.warmup_steps >= 0, "optim.warmup_steps", o.warmup_steps, "must be ≥ 0")
    require(o.step_size >= 1, "optim.step_size", o.step_size, "must be ≥ 1")
    require(_finite(o.gamma), "optim.gamma", o.gamma, "must be a finite number ≥ 0")
    require(_finite(o.min_lr) and o.min_lr <= o.lr, "optim.min_lr", o.min_lr,
           f"must be in [0, optim.lr={o.lr}]")


def _validate_sparse(sp) -> None:
    one_of(Partition.STRATEGIES, sp.partition, "sparse.partition")
    one_of(SPARSE_OPTIMIZERS, sp.optimizer, "sparse.optimizer")
    require(_finite(sp.lr), "sparse.lr", sp.lr, "must be a finite number ≥ 0")
    # adagrad divides by sqrt(accumulator) + eps: a touched row whose gradient is zero would
    # be 0/0 with eps = 0 (NaN); adam likewise before its first nonzero gradient
    require(sp.optimizer == "sgd" or (_finite(sp.eps) and sp.eps > 0), "sparse.eps", sp.eps,
            f"must be a finite number > 0 (sparse.optimizer={sp.optimizer} divides by it)")
    require(_finite(sp.weight_decay), "sparse.weight_decay", sp.weight_decay,
            "must be a finite number ≥ 0")
    require(sp.weight_decay == 0 or sp.optimizer != "adam", "sparse.weight_decay",
            sp.weight_decay, "is not applied by sparse.optimizer=adam (lazy Adam decays no "
            "row): set 0, or use sgd or adagrad")
    require(len(sp.betas) == 2 and all(_finite(b) and b < 1 for b in sp.betas), "sparse.betas",
           list(sp.betas), "must be two numbers in [0, 1)")
    for key in ("cache_rows", "cache_staleness"):
        value = getattr(sp, key)
        require(isinstance(value, int) and not isinstance(value, bool) and value >= 0,
                f"sparse.{key}", value, "must be an integer ≥ 0 (0: no hot-row cache)")
    one_of(("hold", "through"), sp.cache_writes, "sparse.cache_writes")
    one_of(("auto", "on", "off"), sp.pull_ahead, "sparse.pull_ahead")
    _validate_dynamic(sp)


def _validate_dynamic(sp) -> None:
    for key in ("hash_size", "max_rows"):
        value = getattr(sp, key)
        require(value is None or (isinstance(value, int) and value >= 1), f"sparse.{key}",
                value, "must be an integer ≥ 1, or null")
    require(not (sp.dynamic and sp.hash_size), "sparse.hash_size", sp.hash_size,
            "must be null with sparse.dynamic=true (a dynamic table keeps every raw id: "
            "nothing is hashed)")
    require(isinstance(sp.admit_after, int) and sp.admit_after >= 1, "sparse.admit_after",
            sp.admit_after, "must be an integer ≥ 1 (1: an id gets a row the first time)")
    one_of(EVICTIONS, sp.evict, "sparse.evict")
    require(sp.evict != "ttl" or (isinstance(sp.ttl_steps, int) and sp.ttl_steps >= 1),
            "sparse.ttl_steps", sp.ttl_steps, "must be an integer ≥ 1 with sparse.evict=ttl")
    require(sp.evict != "lfu" or sp.max_rows, "sparse.max_rows", sp.max_rows,
            "must be set (rows per table, over all PS) with sparse.evict=lfu")


_HYDRA_KEYS = {"_target_", "_args_", "_recursive_", "_convert_", "_partial_"}


def _validate_hooks(hooks: list) -> None:
    """Every hook's `_target_` imports and takes the given arguments; nothing is built here (the
    chief builds them, after the cluster is up)."""
    for i, spec in enumerate(hooks):
        key = f"hooks[{i}]"
        target = spec.get("_target_") if isinstance(spec, dict) else None
        require(isinstance(target, str), key, spec,
               "must be a mapping with _target_: an import path, e.g. psrpc.hooks.StopAtStep")
        try:
            obj = _locate(target)
        except Exception as e:  # ImportError from the module's own failure, or a bad path
            cause = e.__cause__ or e
            raise ConfigError(f"{key}._target_={target!r}: cannot import it "
                              f"({type(cause).__name__}: {cause})") from None
        require(callable(obj), f"{key}._target_", target, "must name a class or a function")
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
    with data built and a batch through the model, is check_run)."""
    for key in ("data", "model", "loss", "metric"):
        check_arguments(key, getattr(cfg, key))
    workers = cfg.data.get("num_workers", 0)
    require(isinstance(workers, int) and workers >= 0, "data.num_workers", workers,
           "must be an int ≥ 0 (0: load in the worker's own process)")


def check_arguments(key: str, node: dict, context: Optional[dict] = None) -> None:
    """The config's arguments fit the factory's signature; with the `context` it will get,
    every parameter without a default is given."""
    fn = locate(key, node)
    args = arguments(key, node)
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: trust it
        return
    takes_any = any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values())
    unknown = [k for k in args if k not in sig.parameters and not takes_any]
    if unknown:
        takes = [n for n, p in sig.parameters.items()
                 if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        raise ConfigError(
            f"{key}.{unknown[0]}: {node['_target_']}() takes no argument {unknown[0]!r} (it "
            f"takes: {', '.join(takes) or 'nothing'}). Keys set for another {key} stay when "
            f"only {key}._target_ changes: start from {key}=custom, or write a config of your "
            "own (docs/own-model.md)")
    if context is None:  # before the data is built: what it passes is not known yet
        return
    given = {**injected(sig, args, context), **args}
    missing = [n for n, p in sig.parameters.items()
               if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
               and n not in given]
    if missing:
        raise ConfigError(f"{key}: {node['_target_']}() needs {missing[0]!r}: set "
                          f"+{key}.{missing[0]}=... (or return it from the dataset factory)")


def check_run(cfg) -> None:
    """Before any process starts: build what every rank will build and put a batch of two
    through it, so that a wrong shape is one clear line here, not a traceback on every rank."""
    check_arguments("data", cfg.data, {"seed": cfg.train.seed})
    data = load_data(cfg)
    for key in ("model", "loss", "metric"):
        check_arguments(key, getattr(cfg, key), data.info)
    model, loss_fn, metric = build_model(cfg, data), build_loss(cfg, data), build_metric(cfg, data)
    _check_tables(cfg, find_tables(model))
    _check_a_batch(cfg, data, model, loss_fn, metric)
    if cfg.parallel.name == "model":
        model_cuts(model, cfg.parallel)  # the model can be cut as asked


def _check_tables(cfg, tables: list) -> None:
    """The model's embedding tables, bound to zeros (no server to ask yet: the shapes are what
    matter): unique names, and what the config asks of them possible."""
    for t in tables:
        t.bind(DryRows(t.specs))
    names = [s.name for t in tables for s in t.specs]
    if len(set(names)) != len(names):
        raise ConfigError(f"model._target_={cfg.model['_target_']!r}: embedding table names "
                          f"must be unique across the model, got {names}")
    dynamic = [s.name for t in tables for s in t.specs if s.dynamic]
    if dynamic and cfg.sparse.cache_rows and cfg.sparse.cache_staleness:
        raise ConfigError(f"sparse.cache_rows={cfg.sparse.cache_rows}: the hot-row cache "
                          f"serves fixed tables only, and tables {dynamic} are dynamic; set "
                          "sparse.cache_rows=0 (or sparse.dynamic=false)")
    if tables and cfg.parallel.name == "model":
        raise ConfigError("parallel=model with embedding tables: tables live on the PS and are "
                          "looked up by data-parallel workers; use parallel=data")


def _check_a_batch(cfg, data, model, loss_fn, metric) -> None:
    """A batch of two through the model, the loss and the metric, each failure named."""
    try:
        x, y = default_collate([data.train[i] for i in range(min(2, len(data.train)))])
    except Exception as e:
        raise ConfigError(f"data._target_={cfg.data['_target_']!r}: its items do not make a "
                          f"batch ({first_line(e)}); an item is an (input, target) pair of "
                          "tensors (or dicts of tensors)") from None
    try:
        with torch.no_grad():
            out = model(x)
    except Exception as e:
        raise ConfigError(f"model._target_={cfg.model['_target_']!r} cannot take a batch of "
                          f"data._target_={cfg.data['_target_']!r}: {first_line(e)} (input "
                          f"{_shape(x)})") from None
    try:
        value = loss_fn(out, y)
        if not (isinstance(value, torch.Tensor) and value.numel() == 1):
            raise ValueError(f"it returned {_shape(value)}, expected a scalar tensor")
    except Exception as e:
        raise ConfigError(f"loss._target_={cfg.loss['_target_']!r} on the model's output "
                          f"{_shape(out)} and the target {_shape(y)}: {first_line(e)}") from None
    try:
        metric.reset()
        metric.update(out, y)
        metric.compute()
    except Exception as e:
        raise ConfigError(f"metric._target_={cfg.metric['_target_']!r} on the model's output "
                          f"{_shape(out)} and the target {_shape(y)}: {first_line(e)}") from None


def _shape(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"{tuple(x.shape)} {str(x.dtype).replace('torch.', '')}"
    if isinstance(x, dict):
        return "{" + ", ".join(f"{k}: {_shape(v)}" for k, v in x.items()) + "}"
    if isinstance(x, (tuple, list)):
        return "(" + ", ".join(_shape(v) for v in x) + ")"
    return type(x).__name__


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
