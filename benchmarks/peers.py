"""The peers psrpc is measured against, run with the same model, data, batch and threads:
single-process training and PyTorch DDP over gloo.

Both reuse psrpc's own data order and loader, model, loss and metric factories and optimizer
builder, so the only difference from a psrpc run is how gradients are combined. Each returns steady-state samples/s;
DDP can also stop at a target test accuracy (time to accuracy, evaluation time included).
"""

from __future__ import annotations

import os
import socket
import time
from typing import Callable, Optional

import torch

from psrpc import factories
from psrpc.config import Config
from psrpc.optim.dense import build_optimizer
from psrpc.worker.batches import GlobalBatches
from psrpc.worker.loader import StepBatches, fetch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_metric(model, cfg: Config, data, batch: int = 1000) -> float:
    """The config's test metric (accuracy by default) of `model`."""
    metric = factories.build_metric(cfg, data)
    model.eval()
    with torch.no_grad():
        for i in range(0, len(data.test), batch):
            x, y = fetch(data.test, torch.arange(i, min(i + batch, len(data.test))))
            metric.update(model(x), y)
    model.train()
    value = metric.compute()
    return next(iter(value.values())) if isinstance(value, dict) else value


def init_gloo(rank: int, world: int, port: Optional[int], always: bool = False) -> None:
    """The peers' gloo group (none for one process, unless `always`): on this machine at
    `port`, or (None) where torchrun says (its MASTER_ADDR and MASTER_PORT: a peer rank on an
    emulated host)."""
    import torch.distributed as dist

    if world <= 1 and not always:
        return
    method = "env://" if port is None else f"tcp://127.0.0.1:{port}"
    dist.init_process_group("gloo", init_method=method, rank=rank, world_size=world)


def train_and_report(model, loss_fn, batches, opts: list, cfg: Config, rank: int, world: int,
                     out) -> None:
    """A peer rank's timed training (`train_timed` over cfg.train.steps); rank 0 puts the
    steady-state samples/s of the whole group in `out`; then the group ends."""
    import torch.distributed as dist

    steps, warm = cfg.train.steps, cfg.train.untimed_steps
    _, elapsed = train_timed(model, loss_fn, batches, opts, steps, warm)
    if rank == 0:
        out.put({"samples_per_s": (steps - warm) * world * cfg.train.batch_size / elapsed})
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _setup(cfg: Config, world: int, rank: int, own_tables: bool = True):
    """What every peer process builds, as a psrpc worker would: data, model, loss, batches.
    The model holds its embedding tables whole, or with `own_tables=False` no rows at all: for a
    peer that puts tables of its own in their place (TorchRec's)."""
    torch.manual_seed(cfg.train.seed)
    data = factories.load_data(cfg)
    model = factories.build_model(cfg, data, remote_tables=not own_tables)
    loss_fn = factories.build_loss(cfg, data)
    B = cfg.train.batch_size
    batches = StepBatches(data.train, GlobalBatches(len(data.train), world * B, cfg.train.seed,
                                                    cfg.train.shuffle),
                          rank, B, torch.device("cpu"), cfg.data.get("num_workers", 0),
                          cfg.train.seed)
    return data, model, loss_fn, batches


def single_process(cfg: Config) -> dict:
    """One process, batch train.batch_size, all the threads."""
    torch.set_num_threads(os.cpu_count())
    data, model, loss_fn, batches = _setup(cfg, 1, 0)
    opt = build_optimizer(list(model.parameters()), cfg.optim)
    B, steps, warm = cfg.train.batch_size, cfg.train.steps, cfg.train.untimed_steps
    _, elapsed = train_timed(model, loss_fn, batches, [opt], steps, warm)
    return {"samples_per_s": (steps - warm) * B / elapsed, "wall_s": elapsed}


# Called with the step number as the clock starts (step `warm`) and with `steps` after the last:
# benchmarks/link_peer.py reads its host's interface counters there.
AT_CLOCK: list[Callable[[int], None]] = []


def train_timed(model, loss_fn, batches, opts: list, steps: int, warm: int,
                after_step: Optional[Callable[[int], bool]] = None) -> tuple[int, float]:
    """Every peer's training loop: global batches 0..steps-1 of `batches`, each optimizer in
    `opts` stepped once per batch, the clock started at step `warm`. `after_step(step)` returns
    True to stop there. Returns (steps done, seconds timed)."""
    t0 = time.perf_counter()
    for step in range(steps):
        if step == warm:
            for fn in AT_CLOCK:
                fn(step)
            t0 = time.perf_counter()
        x, y = batches.get(step)
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        for opt in opts:
            opt.step()
        if after_step is not None and after_step(step):
            return step + 1, time.perf_counter() - t0
    elapsed = time.perf_counter() - t0
    for fn in AT_CLOCK:
        fn(steps)
    return steps, elapsed


def _ddp_rank(rank: int, world: int, port: int, cfg: Config, threads: int, slow_s: float,
              slow_rank, eval_every: int, target: Optional[float], out) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(threads)
    init_gloo(rank, world, port)
    data, model, loss_fn, batches = _setup(cfg, world, rank)
    model = DDP(model)
    opt = build_optimizer(list(model.parameters()), cfg.optim)
    B, steps, warm = cfg.train.batch_size, cfg.train.steps, cfg.train.untimed_steps
    stop = torch.zeros(1)

    def after_step(step: int) -> bool:
        if rank == slow_rank and slow_s:
            time.sleep(slow_s)  # the same straggler as psrpc's fault.slow_worker, once a step
        if target is None or (step + 1) % eval_every:
            return False
        if rank == 0 and test_metric(model.module, cfg, data) >= target:
            stop.fill_(1)
        dist.broadcast(stop, 0)  # the others wait for rank 0's evaluation
        return bool(stop.item())

    done, trained_s = train_timed(model, loss_fn, batches, [opt], steps, warm, after_step)
    if rank == 0:
        out.put({"samples_per_s": (done - (0 if target else warm)) * world * B / trained_s,
                 "wall_s": trained_s, "steps": done, "reached": bool(stop.item())})
    dist.barrier()
    dist.destroy_process_group()


def ddp(cfg: Config, slow_s: float = 0.0, slow_rank: Optional[int] = None,
        eval_every: int = 0, target: Optional[float] = None) -> dict:
    """torch DDP over gloo, W = cluster.num_workers processes of batch B, cores / W threads.
    With `target`, stops once rank 0's test accuracy reaches it (checked every `eval_every`)."""
    world = cfg.cluster.num_workers
    threads = cfg.cluster.worker_threads or max(1, (os.cpu_count() or 1) // world)
    return run_ranks(_ddp_rank, world, cfg, threads, slow_s, slow_rank, eval_every, target)


def run_ranks(rank_fn, world: int, *args) -> dict:
    """Start `world` processes `rank_fn(rank, world, port, *args, out)` from the forkserver
    psrpc's own processes come from (the same start-up), wait for them, and return what rank 0
    put in `out`."""
    from psrpc.spawn import process_context

    ctx = process_context()
    out = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=rank_fn, args=(r, world, port, *args, out))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(3600)
    if any(p.exitcode != 0 for p in procs):
        raise RuntimeError(f"DDP peer failed: exit codes {[p.exitcode for p in procs]}")
    return out.get()
