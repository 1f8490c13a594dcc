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
from dataclasses import replace
from typing import Callable, Optional

import torch
import torch.distributed.autograd as dist_autograd
from torch.func import functional_call
from torch.futures import Future

from psrpc import factories
from psrpc.cluster import comm
from psrpc.cluster.layout import Layout
from psrpc.cluster.topology import Topology
from psrpc.cluster.wire import WIRE_DTYPES, Reply
from psrpc.config import Config
from psrpc.factories import Data
from psrpc.faults import build_faults
from psrpc.models.stages import stage_module
from psrpc.optim.treesum import Scratch, tree_sum
from psrpc.worker.client import ShardClient
from psrpc.worker.flat import FlatModel
from psrpc.worker.loader import split_batch, to_device
from psrpc.worker.plan import Plan
from psrpc.worker.replica import AMP_DTYPES, Replica, load_buffers, model_buffers, pick_device

_NO_PARAMS = torch.empty(0)


def _own_threads(grad: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """Give the calling thread the process's intra-op thread count (torch.set_num_threads,
    cluster.worker_threads). torch applies it to a thread lazily, when the thread first asks:
    until then an RPC thread's GEMMs run with OpenMP's and MKL's defaults (every core), which
    oversubscribes the host and rounds differently from the worker's own thread count."""
    torch.get_num_threads()  # (the ask)
    return grad


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
        self._scratch = Scratch()  # the micro-batches' tree sum
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
        enough to move a ReLU input across zero and change the trained model.
        The forward and (through a hook on its output) the backward run in RPC threads, which
        take the process's intra-op thread count only once they ask for it (`_own_threads`)."""
        _own_threads()
        with self.compute_lock:
            leaves = {n: p.detach().requires_grad_() for n, p in self.named}
            self._leaves[micro] = list(leaves.values())
            with torch.autocast(self.device.type,
                                dtype=getattr(torch, self.autocast or "float32"),
                                enabled=self.autocast is not None):
                y = functional_call(self.module, leaves, (to_device(x, self.device),))
            if y.requires_grad:
                y.register_hook(_own_threads)
            return to_device(y, torch.device("cpu"))

    @comm.async_execution
    def push(self, context_id: int, loss: float, samples: int, ticket: Optional[int] = None):
        """Push this stage's gradients of step `context_id` to its shards; Future of the Reply.
        `ticket`: the staleness clock's, with bounded staleness."""
        grads = dist_autograd.get_gradients(context_id)
        self.flat.zero_grad()
        with torch.no_grad():  # the micro-batches' sum in a round's order (optim/treesum.py)
            for i, p in enumerate(self.params):
                items = [(micro, 0, grads[self._leaves[micro][i]]) for micro in
                         sorted(self._leaves) if self._leaves[micro][i] in grads]
                if items:
                    total = tree_sum(items, p.grad, self._scratch.like(p.grad))
                    if total is not p.grad:
                        p.grad.copy_(total)
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
