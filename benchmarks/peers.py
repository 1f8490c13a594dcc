"""The peers psrpc is measured against, run with the same model, data, batch and threads:
single-process training and PyTorch DDP over gloo. Each returns steady-state samples/s.

Both reuse psrpc's own data order (DESIGN §4), model registry and torch.optim, so the only
difference from a psrpc run is how gradients are combined.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Optional

import torch
import torch.nn.functional as F

from psrpc.config import Config
from psrpc.data import GlobalBatches, load_dataset
from psrpc.models import build_model
from psrpc.optim import build_optimizer


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train_loop(cfg: Config, rank: int, world: int, model, step_fn, slow_s: float = 0.0,
                slow_rank: Optional[int] = None, deadline_hook=None) -> dict:
    """Shared loop: returns steady-state samples/s (global) and per-step losses."""
    data = load_dataset(cfg.data, cfg.train.seed)
    B, steps, warm = cfg.train.batch_size, cfg.train.steps, cfg.train.warmup_steps
    batches = GlobalBatches(len(data.train), world * B, cfg.train.seed)
    t_start = None
    for step in range(steps):
        if step == warm:
            t_start = time.perf_counter()
        idx = batches.slice_for(step, rank, B)
        loss = step_fn(data.train.x[idx], data.train.y[idx], slow_s if rank == slow_rank else 0.0)
        if deadline_hook is not None:
            deadline_hook(step, loss, model)
    elapsed = time.perf_counter() - t_start
    return {"samples_per_s": (steps - warm) * world * B / elapsed, "wall_s": elapsed}


def single_process(cfg: Config, threads: Optional[int] = None) -> dict:
    """One process, the whole batch (W × B with W = cluster.num_workers), all the threads."""
    torch.set_num_threads(threads or os.cpu_count())
    torch.manual_seed(cfg.train.seed)
    data = load_dataset(cfg.data, cfg.train.seed)
    model = build_model(cfg.model.name, data.image_shape, data.num_classes)
    opt = build_optimizer(list(model.parameters()), cfg.optim)

    def step(x, y, slow_s):
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss.item()

    return _train_loop(cfg, 0, 1, model, step)


def _ddp_rank(rank: int, world: int, port: int, cfg: Config, threads: int, slow_s: float,
              slow_rank, out):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    torch.manual_seed(cfg.train.seed)
    data = load_dataset(cfg.data, cfg.train.seed)
    model = DDP(build_model(cfg.model.name, data.image_shape, data.num_classes))
    opt = build_optimizer(list(model.parameters()), cfg.optim)

    def step(x, y, slow):
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        if slow:
            time.sleep(slow)  # the same straggler as psrpc's fault.slow_worker
        loss.backward()
        opt.step()
        return loss.item()

    result = _train_loop(cfg, rank, world, model, step, slow_s, slow_rank)
    if rank == 0:
        out.put(result)
    dist.barrier()
    dist.destroy_process_group()


def ddp(cfg: Config, slow_s: float = 0.0, slow_rank: Optional[int] = None) -> dict:
    """torch DDP over gloo, W = cluster.num_workers processes of batch B, cores / W threads."""
    world = cfg.cluster.num_workers
    threads = cfg.cluster.worker_threads or max(1, (os.cpu_count() or 1) // world)
    from psrpc.launch import process_context

    ctx = process_context()  # the forkserver psrpc's own processes come from: same start-up
    out = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_ddp_rank,
                         args=(r, world, port, cfg, threads, slow_s, slow_rank, out))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(3600)
    if any(p.exitcode != 0 for p in procs):
        raise RuntimeError(f"DDP peer failed: exit codes {[p.exitcode for p in procs]}")
    return out.get()
