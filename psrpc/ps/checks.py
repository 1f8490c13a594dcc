"""The checks on a push, before anything changes (mixed into Shard; a table shard checks its
own payload): a bad push is refused with a message naming the worker, the argument and what
would be right."""

from __future__ import annotations

import torch

from psrpc.cluster import shm
from psrpc.errors import PushRejected


class PushChecks:
    """Mixed into Shard: uses its name, version, updater, slots, params and wire dtype."""

    def _check_worker_version(self, worker, version) -> None:
        name = self.name
        if type(worker) is not int or not 0 <= worker < self.num_workers:
            raise PushRejected(f"{name}: push from unknown worker {worker!r} "
                               f"(workers are 0..{self.num_workers - 1})")
        if type(version) is not int or version < 0:
            raise PushRejected(f"{name}: worker{worker} pushed a gradient for step {version!r}; "
                               "a step is an int >= 0")
        if version > self.version:
            raise PushRejected(f"{name}: worker{worker} pushed a gradient for step {version!r}, "
                               f"but this shard is at step {self.version} (a step from the future)")

    def _check(self, worker, version, grad, loss, samples, ticket) -> None:
        """Every argument of a push, before anything changes."""
        name = self.name
        self._check_worker_version(worker, version)
        if not shm.is_marker(grad, shm.VOID):
            self._check_payload(worker, grad)
        elif not getattr(self.updater, "takes_void", False):
            raise PushRejected(f"{name}: worker{worker} pushed {grad!r}: only sync rounds take it")
        if type(loss) not in (int, float):
            raise PushRejected(f"{name}: worker{worker} pushed loss {loss!r}, expected a number")
        if type(samples) is not int or samples < 0:
            raise PushRejected(f"{name}: worker{worker} pushed samples={samples!r}, expected an "
                               "int >= 0")
        ordered = getattr(self.updater, "ordered", False)
        if ordered and (type(ticket) is not int or ticket < 0):
            raise PushRejected(f"{name}: worker{worker} pushed ticket {ticket!r}: with "
                               "update.max_staleness set every push needs a ticket from admit")
        if not ordered and ticket is not None:
            raise PushRejected(f"{name}: worker{worker} pushed ticket {ticket!r}, but this "
                               "shard takes no tickets (only bounded async does)")

    def _check_payload(self, worker: int, grad) -> None:
        """A dense shard's gradient: one flat CPU tensor of its length, in the wire dtype; or
        shm.SLOT from a worker that has a slot here."""
        name = self.name
        if isinstance(grad, str):
            if grad != shm.SLOT or worker not in self.slots:
                raise PushRejected(f"{name}: worker{worker} pushed {grad!r}, but it has no "
                                   "shared-memory slot on this shard")
            return
        if not isinstance(grad, torch.Tensor):
            raise PushRejected(f"{name}: worker{worker} pushed a {type(grad).__name__}, "
                               "expected a flat tensor")
        if grad.dim() != 1 or grad.numel() != self.params.numel():
            raise PushRejected(f"{name}: worker{worker} pushed shape {tuple(grad.shape)}, "
                               f"expected ({self.params.numel()},) (this shard's flat length)")
        if grad.dtype != self.wire_dtype:
            raise PushRejected(f"{name}: worker{worker} pushed dtype {grad.dtype}, expected "
                               f"{self.wire_dtype} (update.wire_dtype)")
        if grad.device.type != "cpu" or grad.layout != torch.strided:
            raise PushRejected(f"{name}: worker{worker} pushed a {grad.layout} tensor on "
                               f"{grad.device}, expected a dense CPU tensor")
