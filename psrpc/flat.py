"""A worker's model parameters and gradients as views into one flat buffer per shard.

As DDP's `gradient_as_bucket_view`: `param.data` and `param.grad` are views into shard k's flat
buffers, so backward writes gradients straight into what is pushed (autograd accumulates into an
existing `.grad` in place) and a pull is one copy per shard. A tensor split across shards keeps
its own storage; its pieces are copied (only tensors over `cluster.max_shard_bytes` are split).

Pushes overlap backward: a post-accumulate-grad hook per parameter tells the worker when a shard's
gradient is complete (see `arm`).

On CUDA the flat buffers live on the GPU and what crosses the wire goes through pinned CPU
staging buffers with non_blocking copies (RPC carries CPU tensors only).
"""

from __future__ import annotations

import torch
from torch import nn

from psrpc.layout import Layout


class FlatModel:
    def __init__(self, model: nn.Module, layout: Layout, device: torch.device,
                 wire_dtype: torch.dtype = torch.float32):
        self.layout, self.device, self.wire_dtype = layout, device, wire_dtype
        named = dict(model.named_parameters())
        missing = set(layout.shapes) - set(named)
        if missing:
            raise ValueError(f"layout names parameters the model lacks: {sorted(missing)[:3]}")
        self.params = [torch.zeros(n, device=device) for n in layout.shard_numel]
        self.grads = [torch.zeros(n, device=device) for n in layout.shard_numel]
        self._split: list[tuple[nn.Parameter, object]] = []  # (param, piece), copied each step
        split = layout.split_names
        for p in layout.pieces:
            param = named[p.name]
            if p.name in split:
                self._split.append((param, p))
                continue
            shape = layout.shapes[p.name]
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
        pin = device.type == "cuda"
        # Staging: what is pushed, when it cannot be the gradient buffer itself.
        self._staging = None if on_cpu_f32 else [
            torch.empty(n, dtype=wire_dtype, pin_memory=pin) for n in layout.shard_numel]

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
        for g in self.grads:
            g.zero_()
        for param, _ in self._split:
            param.grad.zero_()

    def all_grads(self) -> list[torch.Tensor]:
        """Every gradient buffer on the device: the flat ones and those of split tensors."""
        return list(self.grads) + [param.grad for param, _ in self._split]

    def _piece(self, t: torch.Tensor, p) -> torch.Tensor:
        return (t if t.dim() == 0 else t[p.row_start:p.row_end]).reshape(-1)

    def grad_to_send(self, shard: int) -> torch.Tensor:
        """Shard `shard`'s gradient as a flat CPU tensor in the wire dtype."""
        g = self.grads[shard]
        for param, p in self._split:
            if p.shard == shard:
                g[p.offset:p.offset + p.numel].copy_(self._piece(param.grad, p))
        if self._staging is None:
            return g  # not touched again before the reply arrives, so no copy is needed
        out = self._staging[shard]
        out.copy_(g, non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        return out

    def load(self, shard: int, flat: torch.Tensor) -> None:
        """Copy a shard's pulled parameters (CPU, wire dtype) into the model."""
        dst = self.params[shard]
        dst.copy_(flat, non_blocking=self.device.type == "cuda")
        for param, p in self._split:
            if p.shard == shard:
                with torch.no_grad():
                    self._piece(param.data, p).copy_(dst[p.offset:p.offset + p.numel])
