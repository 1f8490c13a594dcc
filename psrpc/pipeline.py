"""Model parallel (`parallel=model`): the model's layers cut into consecutive stages, one per
worker of a pipeline replica, with micro-batches pipelined through them (fill-drain).

Worker i holds stage i % S of replica i // S. The replica's leader (its stage-0 worker) creates a
`Stage` on each of its stage workers (`comm.remote`), then per step:
- sends every micro-batch to stage 0 with `rpc_async`; a stage runs its layers and forwards the
  result to the next stage itself, returning that call's Future (`async_execution`: no RPC
  thread waits), so stage s works on micro-batch m+1 while stage s+1 works on m; each stage
  runs its micro-batches one at a time, in order;
- computes the loss on the last stage's outputs and runs `dist_autograd.backward`: gradients
  land in each stage worker's autograd context (not in `.grad`: PyTorch's own pipeline example
  never updates its parameters because of this);
- asks every stage to push: a stage reads its gradients from the context
  (`dist_autograd.get_gradients`; one per micro-batch, summed in micro-batch order so that a
  run is reproducible) into its flat per-shard buffers and `push_pull`s them to its own shards,
  through the same sync/async update rules as data parallelism.
Each stage's parameters have their own shards on the PS (numbered stage by stage; the stage's
layout says which PS holds each), aggregated over the R replicas.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import replace
from typing import Callable, Optional

import torch
import torch.distributed.autograd as dist_autograd
from torch import nn
from torch.func import functional_call
from torch.futures import Future

from psrpc.cluster import comm
from psrpc import factories
from psrpc.config import AMP_DTYPES, Config
from psrpc.errors import ConfigError
from psrpc.factories import Data
from psrpc.faults import build_faults
from psrpc.flat import FlatModel
from psrpc.cluster.layout import Layout
from psrpc.loader import split_batch, to_device
from psrpc.cluster.wire import WIRE_DTYPES, Reply
from psrpc.cluster.topology import Topology
from psrpc.worker import (Plan, Replica, ShardClient, load_buffers, model_buffers,
                          pick_device)

_NO_PARAMS = torch.empty(0)


# -- cutting the model ---------------------------------------------------------------------------
def pipeline_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The layers stages are cut between, in forward order, with their names in the model: an
    nn.Sequential's children, or what the model's `pipeline_layers()` lists (its forward must
    be those layers applied one after another)."""
    if isinstance(model, nn.Sequential):
        return [(str(i), m) for i, m in enumerate(model)]
    listed = getattr(model, "pipeline_layers", None)
    if not callable(listed):
        raise ConfigError(
            f"parallel=model cuts the model into stages of consecutive layers: it must be an "
            f"nn.Sequential, or define pipeline_layers() returning its layers in forward order; "
            f"{type(model).__name__} is neither")
    names = {id(m): n for n, m in model.named_modules() if n}
    layers = list(listed())
    unknown = [type(m).__name__ for m in layers if id(m) not in names]
    if unknown or not layers:
        raise ConfigError(f"{type(model).__name__}.pipeline_layers() must list submodules of "
                          f"the model (got {unknown[0] if unknown else 'none'})")
    return [(names[id(m)], m) for m in layers]


class StageModule(nn.Module):
    """Consecutive layers of a model, registered under their names in the whole model (so
    parameters and buffers are named as in model.pt); forward runs them in order."""

    def __init__(self, layers: list[tuple[str, nn.Module]]):
        super().__init__()
        self._order: list[nn.Module] = [m for _, m in layers]
        for path, module in layers:
            parent = self
            *outer, last = path.split(".")
            for part in outer:  # empty containers mirroring the model's nesting
                if not hasattr(parent, part):
                    parent.add_module(part, nn.Module())
                parent = getattr(parent, part)
            parent.add_module(last, module)

    def forward(self, x):
        for layer in self._order:
            x = layer(x)
        return x


def cut_points(layers: list[nn.Module], stages: int, split: Optional[list[int]] = None) -> list[int]:
    """Index of the first layer of each stage. Every stage holds at least one layer with
    parameters; by default the cuts minimise the largest stage's parameter count."""
    sizes = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    holders = [i for i, n in enumerate(sizes) if n]
    if stages > len(holders):
        raise ConfigError(f"parallel.stages={stages}: the model has only {len(holders)} layers "
                          f"with parameters to cut between ({len(layers)} layers in all); use at "
                          f"most {len(holders)} stages")
    if split is not None:
        cuts = [0] + list(split)
        bounds = cuts + [len(layers)]
        ok = (len(split) == stages - 1 and all(a < b for a, b in zip(bounds, bounds[1:]))
              and all(any(sizes[a:b]) for a, b in zip(bounds, bounds[1:])))
        if not ok:
            raise ConfigError(
                f"parallel.split={list(split)}: need {stages - 1} increasing layer indices in "
                f"1..{len(layers) - 1} so that every stage has parameters (layer sizes: {sizes})")
        return cuts
    # Balanced: try every way to put the S-1 cuts just before a parameter-holding layer.
    best: tuple[float, list[int]] = (float("inf"), [])

    def search(start_holder: int, left: int, cuts: list[int]) -> None:
        nonlocal best
        if left == 0:
            bounds = cuts + [len(layers)]
            worst = max(sum(sizes[a:b]) for a, b in zip(bounds, bounds[1:]))
            best = min(best, (worst, list(cuts)))
            return
        for h in range(start_holder, len(holders) - left + 1):
            search(h + 1, left - 1, cuts + [holders[h]])

    search(1, stages - 1, [0])
    return best[1]


def model_cuts(model: nn.Module, cfg: Config) -> list[int]:
    return cut_points([m for _, m in pipeline_layers(model)], cfg.parallel.stages,
                      cfg.parallel.split)


def stage_module(model: nn.Module, cuts: list[int], stage: int) -> StageModule:
    """Stage `stage`'s layers, named as in the whole model."""
    layers = pipeline_layers(model)
    end = cuts[stage + 1] if stage + 1 < len(cuts) else len(layers)
    return StageModule(layers[cuts[stage]:end])


def stage_shapes(model: nn.Module, cuts: list[int]) -> list[dict[str, tuple]]:
    return [{n: tuple(p.shape) for n, p in stage_module(model, cuts, s).named_parameters()}
            for s in range(len(cuts))]


# -- one stage, on its worker -------------------------------------------------------------------
class Stage:
    """Layers [a, b) of the model on one worker, with their flat buffers and shard client."""

    def __init__(self, cfg: Config, stage: int, cuts: list[int], layout: Layout, shards: list,
                 replica: int, local_rank: int, worker: int, restart_count: int,
                 info: dict, buffers: Optional[dict[str, torch.Tensor]] = None):
        self.device = pick_device(cfg.train.device, local_rank)
        model = factories.build_model(cfg, Data(None, None, info))  # `info`: the dataset's
        self.module = stage_module(model, cuts, stage).to(self.device)
        self.autocast = AMP_DTYPES[cfg.train.amp]
        self.clip = cfg.train.clip_grad_norm
        load_buffers(self.module, buffers)  # restored: the checkpoint's, for this stage's layers
        self.named = list(self.module.named_parameters())
        self.params = [p for _, p in self.named]
        self._leaves: dict[int, list[torch.Tensor]] = {}  # micro-batch -> its parameter leaves
        self.flat = FlatModel(self.module, layout, self.device,
                              WIRE_DTYPES[cfg.update.wire_dtype])
        self.client = ShardClient(shards, replica)
        self.faults = build_faults(cfg.fault, "worker", worker, restart_count)
        self.next: Optional[comm.RRef] = None
        # Micro-batches run one at a time and in order (BatchNorm's running statistics depend
        # on the order): whichever RPC thread finds the stage idle runs every micro-batch whose
        # turn has come, the others just queue theirs; no RPC thread waits.
        self.lock = threading.Lock()  # guards the queue
        self.compute_lock = threading.Lock()  # the module, while a micro-batch runs
        self._queue: dict[int, tuple[torch.Tensor, Future]] = {}
        self._turn = 0  # the micro-batch to run next (push starts the next step at 0)
        self._running = False
        self.reply = self._load(self.client.pull())

    def set_next(self, rref: comm.RRef) -> None:
        self.next = rref

    def first_reply(self) -> Reply:
        return self.reply

    def buffers(self) -> dict[str, torch.Tensor]:
        """This stage's buffers (BatchNorm statistics), named as in the full model."""
        with self.compute_lock:
            return {n: b.detach().cpu().clone() for n, b in model_buffers(self.module).items()}

    @comm.async_execution
    def forward(self, x: torch.Tensor, micro: int):
        """Run this stage on micro-batch `micro` and hand the result on; the Future holds the
        last stage's output. Runs inside the leader's distributed autograd context (one per
        step, shared by the step's micro-batches)."""
        done: Future = Future()
        with self.lock:
            self._queue[micro] = (x, done)
            if self._running:
                return done
            self._running = True
        self._run_queued()
        return done

    def _run_queued(self) -> None:
        while True:
            with self.lock:
                micro = self._turn
                item = self._queue.pop(micro, None)
                if item is None:
                    self._running = False
                    return
                self._turn += 1
            x, done = item
            try:
                y = self._compute(x, micro)
                if self.next is None:
                    done.set_result(y)
                else:
                    comm.invoke(self.next, "forward", y, micro).then(
                        lambda f, done=done: _pass_on(f, done))
            except Exception as e:  # the leader's wait raises it
                done.set_exception(e)

    def _compute(self, x: torch.Tensor, micro: int) -> torch.Tensor:
        """Each micro-batch runs on its own leaves of the parameters (`detach()`: same storage,
        no copy), so distributed autograd keeps one gradient per micro-batch and `push` sums
        them in micro-batch order. Left to itself it would sum them into one tensor in whatever
        order the concurrent backward passes arrive: rounding that differs run to run, and is
        enough to move a ReLU input across zero and change the trained model."""
        with self.compute_lock:
            leaves = {n: p.detach().requires_grad_() for n, p in self.named}
            self._leaves[micro] = list(leaves.values())
            with torch.autocast(self.device.type,
                                dtype=getattr(torch, self.autocast or "float32"),
                                enabled=self.autocast is not None):
                y = functional_call(self.module, leaves, (to_device(x, self.device),))
            return to_device(y, torch.device("cpu"))

    @comm.async_execution
    def push(self, context_id: int, loss: float, samples: int, ticket: Optional[int] = None):
        """Push this stage's gradients of step `context_id` to its shards; Future of the Reply.
        `ticket`: the staleness clock's, with bounded staleness."""
        grads = dist_autograd.get_gradients(context_id)
        self.flat.zero_grad()
        with torch.no_grad():
            for micro in sorted(self._leaves):
                for p, leaf in zip(self.params, self._leaves[micro]):
                    if leaf in grads:
                        p.grad.add_(grads[leaf])
        self.discard()
        if self.clip:  # this stage's own gradient norm (per worker, as in data parallel)
            torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        self.faults.before_backward(self.reply.version)
        self.faults.corrupt(self.reply.version, self.flat.all_grads())
        sends = [self.flat.grad_to_send(k) for k in range(len(self.flat.params))]
        futures = self.client.push_pull_async(self._versions, sends, loss, samples, ticket)
        return torch.futures.collect_all(futures).then(
            lambda _: self._load(self.client.wait(futures)))

    def discard(self) -> None:
        """Forget this step's micro-batches (pushed, or not admitted by the staleness clock)."""
        self._leaves.clear()
        with self.lock:
            self._turn = 0

    def refresh(self) -> Reply:
        """Pull this stage's parameters afresh."""
        return self._load(self.client.pull())

    def _load(self, replies: list[Reply]) -> Reply:
        """Load the pulled parameters; the leader gets the first shard's Reply without them
        (it needs the step and the counters, not another copy of this stage's weights)."""
        for k, r in enumerate(replies):
            self.flat.load(k, r.params)
        self._versions = [r.version for r in replies]
        # After a pull the shards' versions can differ (bounded staleness, tickets in flight):
        # the oldest one is this stage's (one version everywhere after a push).
        self.reply = replace(replies[0], params=_NO_PARAMS, version=min(self._versions))
        return self.reply


def _pass_on(src: Future, dst: Future) -> None:
    try:
        dst.set_result(src.value())
    except Exception as e:
        dst.set_exception(e)


# -- the replica's leader: feeds the pipeline ------------------------------------------------------
class PipelineLeader(Replica):
    def __init__(self, cfg: Config, topo: Topology, plan: Plan, model=None, dataset=None):
        super().__init__(cfg, topo, plan, dataset)
        self.model = model  # the chief's full model (for its final evaluation); None elsewhere
        if self.model is None and topo.is_chief:
            self.model = self.build_model(cfg, self.data)
        if self.model is not None:
            self.model.to(self.device)
            load_buffers(self.model, plan.buffers)
        self.microbatches = cfg.parallel.microbatches
        names = topo.stage_workers(self.replica)
        self.stages = []
        for s, name in enumerate(names):
            rank = topo.rank_of(name)
            self.stages.append(comm.remote(name, Stage, args=(
                cfg, s, plan.cuts, plan.layouts[s], plan.shards[s], self.replica,
                topo.local_rank_of(rank), topo.role_of(rank)[1], topo.restart_count,
                self.data.info, plan.buffers)))
        for s in range(len(names) - 1):
            comm.invoke(self.stages[s], "set_next", self.stages[s + 1]).wait()
        self.client = ShardClient(plan.shards[0], self.replica)  # for the staleness clock

    def buffers(self) -> dict[str, torch.Tensor]:
        """The replica's buffers, from the stages that own them."""
        out: dict[str, torch.Tensor] = {}
        for part in comm.wait_all([comm.invoke(st, "buffers") for st in self.stages]):
            out.update(part)
        return out

    def step(self, step: int, version: int) -> tuple[Optional[list[Reply]], float]:
        """Forward M micro-batches of global batch `step` through the pipeline, backward, push
        every stage (whose parameters are at `version`). Replies None: the staleness clock did
        not admit the gradient (see Worker.step)."""
        x, y = self.batches.get(step)
        cpu = torch.device("cpu")  # RPC carries CPU tensors
        with dist_autograd.context() as ctx:
            outs = comm.wait_all([comm.invoke(self.stages[0], "forward", to_device(xm, cpu), m)
                                  for m, xm in enumerate(split_batch(x, self.microbatches))])
            loss = self.loss_fn(torch.cat(outs).to(self.device), y)
            dist_autograd.backward(ctx, [loss])
            value = loss.item()
            ticket = None
            if self.bounded:
                admitted = self.client.admit(self.clock, version)
                if admitted.seq is None:
                    self.finished = admitted.finished
                    # the stages drop this step's leaves: the next forward starts afresh
                    comm.wait_all([comm.invoke(st, "discard") for st in self.stages])
                    return None, value
                ticket = admitted.seq
            replies = comm.wait_all([comm.invoke(st, "push", ctx, value, self.batch, ticket)
                                     for st in self.stages])
        return replies, value

    def run(self, after_step: Callable[[Reply, float, float], bool] = lambda *a: False) -> None:
        reply = comm.invoke(self.stages[0], "first_reply").wait()
        self.finished = False
        while not reply.finished:
            t0 = time.perf_counter()
            step = self.data_step(reply.version)
            replies, loss = self.step(step, reply.version)
            if replies is None:  # not admitted: training is over, or pull fresher parameters
                if self.finished:
                    break
                replies = comm.wait_all([comm.invoke(st, "refresh") for st in self.stages])
                reply = replace(replies[0], version=min(r.version for r in replies))
                continue
            self.next_data_step()
            reply = replies[0]
            self.stats.pushes += 1
            self.stats.accepted += int(reply.accepted)
            self.stats.compute_s += time.perf_counter() - t0
            self.nonfinite.after_push(any(r.skipped for r in replies), step, loss)
            if after_step(reply, 0.0, loss):
                break
