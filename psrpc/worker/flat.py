"""A worker's model parameters and gradients as views into one flat buffer per shard.

As DDP's `gradient_as_bucket_view`: `param.data` and `param.grad` are views into shard k's flat
buffers, so backward writes gradients straight into what is pushed (autograd accumulates into an
existing `.grad` in place) and a pull is one copy per shard. A tensor split across shards keeps
its own storage; its pieces are copied (only tensors over `cluster.max_shard_bytes` are split).

Pushes overlap backward: a post-accumulate-grad hook per parameter tells the worker when a shard's
gradient is complete (see `arm`).

With a PS on the same host (`cluster.shm`, psrpc/cluster/shm.py) a shard's gradient buffer is the
worker's slot in shared memory (backward writes where the PS reads) and, in sync training with
every worker in each round, its parameter buffer is a view of the master copy itself: no copy
either way.

On CUDA the flat buffers live on the GPU; what crosses to the PS goes through pinned CPU buffers
(staging, or the shared slot and master copy, registered with CUDA) with non_blocking copies on a
copy stream ordered by events, and a sender thread waits for each copy: backward never waits for
a bucket's copy, and forward waits (on the GPU) only for the parameters it reads.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional

import torch
from torch import nn

from psrpc.cluster import shm as shm_mod
from psrpc.cluster.layout import Layout

log = logging.getLogger(__name__)


class FlatModel:
    def __init__(self, model: nn.Module, layout: Layout, device: torch.device,
                 wire_dtype: torch.dtype = torch.float32, shm: Optional[list] = None):
        """`shm[k]`: None (shard k over TCP), or (mode, params segment, slot segment) with mode
        "views" or "slots" (psrpc/cluster/shm.py)."""
        self.layout, self.device, self.wire_dtype = layout, device, wire_dtype
        named = self._named = dict(model.named_parameters())
        missing = set(layout.shapes) - set(named)
        if missing:
            raise ValueError(f"layout names parameters the model lacks: {sorted(missing)[:3]}")
        cuda = device.type == "cuda"
        self.shm = list(shm) if shm is not None else [None] * layout.num_shards
        self.params, self.grads = [], []
        self._host: list[Optional[torch.Tensor]] = []  # CUDA: the shared slot, pinned
        self._host_params: list[Optional[torch.Tensor]] = []  # CUDA: the shared master, pinned
        self._view = [False] * layout.num_shards  # params[k] is the master copy itself
        # Views: the master copy's write sequence, and its value when this worker took the
        # parameters (`load`); see `intact`.
        self._seq: list[Optional[torch.Tensor]] = [None] * layout.num_shards
        self._seen: list[int] = [0] * layout.num_shards
        self._unsent: set[int] = set()  # shards not pushed yet this step
        self._torn = False  # this step's gradients were computed across an update
        for k, n in enumerate(layout.shard_numel):
            mode = self.shm[k]
            slot = shm_mod.attach(mode[2], n) if mode else None
            master = None
            if mode and mode[0] == "views":
                master, self._seq[k] = shm_mod.attach_master(mode[1], n)
            if cuda:
                self.params.append(torch.zeros(n, device=device))
                self.grads.append(torch.zeros(n, device=device))
                self._host.append(_pinned(slot))
                self._host_params.append(_pinned(master))
            else:
                self._view[k] = master is not None
                self.params.append(master if master is not None else torch.zeros(n))
                self.grads.append(slot if slot is not None else torch.zeros(n))
                self._host.append(None)
                self._host_params.append(None)
        self._split: list[tuple[nn.Parameter, object]] = []  # (param, piece), copied each step
        split = layout.split_names
        for p in layout.pieces:
            param = named[p.name]
            if p.name in split:
                self._split.append((param, p))
                continue
            shape = layout.shapes[p.name]
            if not self._view[p.shard]:  # never write into the master copy: it holds the truth
                with torch.no_grad():
                    self.params[p.shard][p.offset:p.offset + p.numel].copy_(param.reshape(-1))
            param.data = self.params[p.shard][p.offset:p.offset + p.numel].view(shape)
            param.grad = self.grads[p.shard][p.offset:p.offset + p.numel].view(shape)
        for param in {id(q): q for q, _ in self._split}.values():
            param.data = param.data.to(device)
            param.grad = torch.zeros_like(param.data)
        # Backward fills shards one after another: a hook per parameter counts what is left of
        # each shard and calls `on_ready(shard)` when its gradient is complete (push it then).
        self._shards_of: dict[int, list[int]] = {}
        for p in layout.pieces:
            self._shards_of.setdefault(id(named[p.name]), []).append(p.shard)
        self._per_shard = [0] * layout.num_shards
        for param in {id(q): q for q in named.values() if id(q) in self._shards_of}.values():
            for k in self._shards_of[id(param)]:
                self._per_shard[k] += 1
            param.register_post_accumulate_grad_hook(self._accumulated)
        self._left: list[int] = []
        self._on_ready = None
        on_cpu_f32 = device.type == "cpu" and wire_dtype == torch.float32
        # Staging: what is pushed over TCP, when it cannot be the gradient buffer itself.
        self._staging = None if on_cpu_f32 else [
            None if self.shm[k] else torch.empty(n, dtype=wire_dtype, pin_memory=cuda)
            for k, n in enumerate(layout.shard_numel)]
        # CUDA: copies to and from the host on their own stream, a thread to wait for them
        self._copy_stream = torch.cuda.Stream(device) if cuda else None
        self._sender = ThreadPoolExecutor(1, thread_name_prefix="psrpc-d2h") if cuda else None
        self._sends: list = []
        self._params_ready: Optional[torch.cuda.Event] = None

    def unshare(self, shard: int) -> None:
        """Shard `shard` no longer shares memory with its PS (it failed over to a backup on
        another PS, cluster.ps_replicas): its parameters become this worker's own buffer (the
        master copy it viewed is a lost PS's) and its gradient is pushed as a tensor. The
        gradient buffer stays where it is (the slot: only this worker writes it)."""
        if not self.shm[shard]:
            return
        n = self.layout.shard_numel[shard]
        if self.device.type == "cuda":
            self._host_params[shard] = None
            if self._staging is None:
                self._staging = [None] * self.layout.num_shards
            self._staging[shard] = torch.empty(n, dtype=self.wire_dtype, pin_memory=True)
        else:
            if self._view[shard]:
                own = self.params[shard].clone()
                for p in self.layout.pieces:
                    if p.shard == shard and p.name not in self.layout.split_names:
                        param = self._named[p.name]
                        param.data = own[p.offset:p.offset + p.numel].view(
                            self.layout.shapes[p.name])
                self.params[shard] = own
                self._view[shard] = False
            if self._staging is not None and self._staging[shard] is None:
                self._staging[shard] = torch.empty(n, dtype=self.wire_dtype)
        self._seq[shard] = None
        self.shm[shard] = None

    def arm(self, on_ready) -> None:
        """For the next backward: call `on_ready(shard)` as each shard's gradient completes."""
        self._left = list(self._per_shard)
        self._on_ready = on_ready

    def disarm(self) -> list[int]:
        """After backward: the shards `on_ready` was not called for (unused parameters)."""
        left = [k for k, n in enumerate(self._left) if n > 0]
        self._on_ready = None
        return left

    def _accumulated(self, param: torch.Tensor) -> None:
        if self._on_ready is None:
            return
        for k in self._shards_of[id(param)]:
            self._left[k] -= 1
            if self._left[k] == 0:
                self._on_ready(k)

    def zero_grad(self) -> None:
        """Before a step's forward: its gradients start at zero, none pushed yet."""
        self._unsent = set(range(len(self.grads)))
        self._torn = False
        for g in self.grads:
            g.zero_()
        for param, _ in self._split:
            param.grad.zero_()

    def all_grads(self) -> list[torch.Tensor]:
        """Every gradient buffer on the device: the flat ones and those of split tensors."""
        return list(self.grads) + [param.grad for param, _ in self._split]

    def _piece(self, t: torch.Tensor, p) -> torch.Tensor:
        return (t if t.dim() == 0 else t[p.row_start:p.row_end]).reshape(-1)

    def _gather_split(self, shard: int) -> torch.Tensor:
        """Shard `shard`'s gradient buffer, with the pieces of split tensors copied in."""
        g = self.grads[shard]
        for param, p in self._split:
            if p.shard == shard:
                g[p.offset:p.offset + p.numel].copy_(self._piece(param.grad, p))
        return g

    def grad_to_send(self, shard: int):
        """Shard `shard`'s gradient as a flat CPU tensor in the wire dtype, or shm.SLOT when
        it is already in the shared slot the PS reads (waits for a CUDA copy)."""
        out = []
        self.send(shard, out.append)
        self.flush()
        return out[0]

    def intact(self) -> bool:
        """Whether this step's gradients so far were computed on the parameters this worker
        took: no master copy it reads in place (views) and has not pushed yet this step has
        been written since its `load` (its write sequence, `shm.writing`, is the even value
        seen then). One it has pushed may be updated (its round closed with this worker, and
        backward no longer reads it); one it has not pushed can only change when a round
        closed without this worker (update.timeout_s), or while being written. Once False,
        False for the rest of the step: every later gradient depends on that forward."""
        if not self._torn:
            self._torn = any(self._seq[k] is not None and (
                self._seen[k] % 2 or int(self._seq[k].item()) != self._seen[k])
                for k in self._unsent)
        return not self._torn

    def _checked(self, shard: int, payload):
        """What to push for shard `shard`: `payload`, or shm.VOID when the gradient was
        computed across an update (`intact`); the shard then counts as pushed this step."""
        ok = self.intact()
        self._unsent.discard(shard)
        return payload if ok else shm_mod.VOID

    def send(self, shard: int, deliver: Callable) -> None:
        """Hand shard `shard`'s gradient to `deliver(tensor, shm.SLOT or shm.VOID)` once it is
        on the host: at once on the CPU; on CUDA from the sender thread, after a copy on the
        copy stream that waits (on the GPU) for backward to have produced it: backward goes on
        meanwhile. shm.VOID: computed across an update of a master copy (`intact`)."""
        g = self._gather_split(shard)
        if self.device.type != "cuda":
            if self.shm[shard]:
                deliver(self._checked(shard, shm_mod.SLOT))  # backward wrote it into the slot
            elif self._staging is None:
                # not touched again before the reply arrives: no copy needed
                deliver(self._checked(shard, g))
            else:
                out = self._staging[shard]
                out.copy_(g)
                deliver(self._checked(shard, out))
            return
        out = self._host[shard] if self.shm[shard] else self._staging[shard]
        produced = torch.cuda.Event()
        produced.record(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._copy_stream):
            self._copy_stream.wait_event(produced)
            out.copy_(g, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self._copy_stream)
        result = shm_mod.SLOT if self.shm[shard] else out
        # checked once the copies are done (in order, on the sender thread): the parameters'
        # copies from the master copy were complete before backward produced this gradient
        self._sends.append(self._sender.submit(
            lambda: (copied.synchronize(), deliver(self._checked(shard, result)))))

    def flush(self) -> None:
        """Wait until every `send` has delivered."""
        for fut in self._sends:
            fut.result()
        self._sends = []

    def load(self, shard: int, flat: torch.Tensor) -> None:
        """A shard's new parameters into the model: the reply's (CPU, wire dtype), or nothing
        to do when the model's buffer is the master copy itself (shared memory); on CUDA from
        the shared master copy, or the reply, on the copy stream (forward waits for it:
        `ready`)."""
        if self._seq[shard] is not None:  # read before the master copy is (seqlock)
            self._seen[shard] = int(self._seq[shard].item())
        if self._view[shard]:
            src = self.params[shard]
        elif self._host_params[shard] is not None and flat.numel() == 0:
            src = self._host_params[shard]
        else:
            src = flat
        dst = self.params[shard]
        if self.device.type == "cuda":
            with torch.cuda.stream(self._copy_stream):
                dst.copy_(src, non_blocking=True)
                self._copy_pieces(shard, dst)
                self._params_ready = torch.cuda.Event()
                self._params_ready.record(self._copy_stream)
            return
        if src is not dst:
            dst.copy_(src)
        self._copy_pieces(shard, dst)

    def _copy_pieces(self, shard: int, dst: torch.Tensor) -> None:
        """The pieces of split tensors (their own storage) from shard `shard`'s buffer."""
        for param, p in self._split:
            if p.shard == shard:
                with torch.no_grad():
                    self._piece(param.data, p).copy_(dst[p.offset:p.offset + p.numel])

    def ready(self) -> None:
        """Before forward: the compute stream waits for the parameters' copies (CUDA)."""
        if self._params_ready is not None:
            torch.cuda.current_stream(self.device).wait_event(self._params_ready)
            self._params_ready = None


def _pinned(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A shared-memory tensor registered with CUDA as page-locked (so copies to and from the GPU
    run asynchronously); None stays None."""
    if t is not None and torch.cuda.is_available():
        cudart = torch.cuda.cudart()
        err = cudart.cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
        if int(err) != 0:  # not pinned: copies are synchronous, still correct
            # The failed call also left CUDA's last error set: the next kernel launch check
            # anywhere in this process (torch checks cudaGetLastError after launches) would
            # raise it against unrelated code. Read it, which clears it.
            cudart.cudaGetLastError()
            log.warning("could not page-lock a shared-memory segment for CUDA (error %d): its "
                        "copies to and from the GPU run synchronously", int(err))
    return t
