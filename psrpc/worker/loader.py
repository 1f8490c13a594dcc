"""A replica's batches, by step, from any map-style dataset; loaded ahead when it can be.

Which samples: `GlobalBatches` (psrpc/worker/batches.py) maps a step to the rows of the global batch; the
replica takes its slice. Loading: with `data.num_workers = 0` in this process; otherwise a
`torch.utils.data.DataLoader` with that many background processes decodes and transforms the
next steps while this one trains (pinned memory when the device is CUDA), so a worker never
waits on decoding. Steps are asked for in order almost always (sync: the global step; async:
the worker's own count), so the loader runs ahead by one step at a time and restarts on the rare
jump (a stale round, a restore).

Per-sample randomness (augmentation) is seeded from (train.seed, epoch, sample index), torch's
and Python's `random` (NumPy's too when it is loaded), so the contract holds for augmented data
too: the same samples, transformed the same way, at step t whatever the number of workers or
loader processes. Loading in this process puts the training process's generators back as they
were: what the model draws (dropout) is never a function of the data (psrpc/worker/rng.py).
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset, default_collate

from psrpc.worker import rng
from psrpc.worker.batches import GlobalBatches


def to_device(batch: Any, device: torch.device) -> Any:
    """Tensors (also inside tuples, lists and dicts) onto `device`."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


def split_batch(batch: Any, parts: int) -> list:
    """`parts` consecutive micro-batches of a batch (tensors, or tuples/lists/dicts of them)."""
    if isinstance(batch, torch.Tensor):
        return list(batch.chunk(parts))
    if isinstance(batch, (list, tuple)):
        return [type(batch)(z) for z in zip(*(split_batch(b, parts) for b in batch))]
    if isinstance(batch, dict):
        cols = {k: split_batch(v, parts) for k, v in batch.items()}
        return [{k: cols[k][i] for k in batch} for i in range(parts)]
    raise TypeError(f"cannot split a batch of {type(batch).__name__} into micro-batches")


def fetch(dataset: Dataset, idx: torch.Tensor, seed: int = 0, first: int = 0) -> Any:
    """The collated items `idx` of `dataset`: whole tensors indexed at once for a
    TensorDataset, or by the dataset's own `batch(indices)` when it has one (no per-sample
    Python); otherwise item by item, each seeded (see above). `first` is the position in the
    sample stream of idx[0] (for the epoch in the seed)."""
    if isinstance(dataset, TensorDataset):
        return tuple(t[idx] for t in dataset.tensors)
    if callable(getattr(dataset, "batch", None)):
        return dataset.batch(idx)
    n = len(dataset)
    items = []
    with rng.kept():  # the training process's generators, as they were before
        for pos, i in enumerate(idx.tolist()):
            rng.seed_all(_sample_seed(seed, (first + pos) // n if first >= 0 else 0, i))
            items.append(dataset[i])
    return default_collate(items)


def _sample_seed(seed: int, epoch: int, index: int) -> int:
    return (seed * 1_000_003 + epoch) * 2_147_483_647 + index & 0x7FFF_FFFF_FFFF_FFFF


class _Tagged(Dataset):
    """Items addressed by (step, stream position, index): returned with their step."""

    def __init__(self, dataset: Dataset, seed: int):
        self.dataset, self.seed, self.n = dataset, seed, len(dataset)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, key):
        step, pos, i = key
        rng.seed_all(_sample_seed(self.seed, pos // self.n, i))  # a loader process's own
        return step, self.dataset[i]


def _collate_tagged(items):
    return items[0][0], default_collate([item for _, item in items])


class _Steps:
    """The DataLoader's batch sampler: one list of keys per step, from `start` on."""

    def __init__(self, keys_for):
        self.keys_for, self.start = keys_for, 0

    def __iter__(self) -> Iterator[list]:
        step = self.start
        while True:
            yield self.keys_for(step)
            step += 1


RECENT = 3  # batches kept: this step's and the two read ahead (sparse.cache_staleness >= 1)


class StepBatches:
    """`get(step)`: this replica's slice of global batch `step`, on `device`."""

    def __init__(self, dataset: Dataset, order: GlobalBatches, replica: int, batch: int,
                 device: torch.device, num_workers: int = 0, seed: int = 0):
        self.dataset, self.order, self.device, self.seed = dataset, order, device, seed
        self.replica, self.batch = replica, batch
        self._loader: Optional[DataLoader] = None
        self._iter = None
        self._coming = 0  # the step the loader hands out next
        self._recent: dict[int, Any] = {}  # the last RECENT batches handed out, by step
        self._window = 2 * num_workers  # steps it prepares ahead (prefetch_factor 2)
        batched = isinstance(dataset, TensorDataset) or callable(getattr(dataset, "batch", None))
        if num_workers > 0 and not batched:  # a batch at a time is already cheap
            self._sampler = _Steps(self._keys)
            self._loader = DataLoader(
                _Tagged(dataset, seed), batch_sampler=self._sampler, num_workers=num_workers,
                collate_fn=_collate_tagged, pin_memory=device.type == "cuda",
                persistent_workers=True, prefetch_factor=2)

    def _first(self, step: int) -> int:
        """Position in the sample stream of this replica's first sample of `step`."""
        return step * self.order.g + self.replica * self.batch

    def _indices(self, step: int) -> torch.Tensor:
        return self.order.slice_for(step, self.replica, self.batch)

    def _keys(self, step: int) -> list:
        first = self._first(step)
        return [(step, first + k, i) for k, i in enumerate(self._indices(step).tolist())]

    def get(self, step: int) -> Any:
        """The batch of `step` (asked again within RECENT steps, the same batch object: the
        worker reads the batches of the next steps early for their table rows)."""
        if step in self._recent:
            return self._recent[step]
        if self._loader is None:
            batch = fetch(self.dataset, self._indices(step), self.seed, self._first(step))
        else:
            batch = self._from_loader(step)
        batch = to_device(batch, self.device)
        self._recent[step] = batch
        if len(self._recent) > RECENT:
            del self._recent[min(self._recent)]
        return batch

    def _from_loader(self, step: int) -> Any:
        # Behind, or far ahead of, what the loader is preparing: start it over at `step`.
        if self._iter is None or not 0 <= step - self._coming <= self._window:
            self._sampler.start = self._coming = step
            self._iter = iter(self._loader)
        while True:
            got, batch = next(self._iter)
            self._coming = got + 1
            if got == step:
                return batch

    def close(self) -> None:
        self._iter = None
        self._loader = None
