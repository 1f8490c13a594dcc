"""The batch-order contract: which samples make the global batch at each step.

The global batch at step t is rows [t·G, (t+1)·G) of an endless stream of per-epoch
permutations seeded by train.seed, with G = replicas × batch; replica i takes rows [i·B, (i+1)·B)
of it. So it is the same set of samples whatever the number of workers, for any map-style
dataset: W workers of batch B see exactly what one worker of batch W·B sees. With
`shuffle=False` (train.shuffle) every epoch is the dataset in its own order: a log replayed in
time order, as streaming recommenders train.
"""

from __future__ import annotations

from typing import Optional

import torch


class GlobalBatches:
    """Which samples make the global batch at each step."""

    def __init__(self, num_samples: int, global_batch: int, seed: int, shuffle: bool = True):
        self.n, self.g, self.seed, self.shuffle = num_samples, global_batch, seed, shuffle
        self._perms: dict[int, torch.Tensor] = {}

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            if not self.shuffle:
                self._perms = {epoch: torch.arange(self.n)}
                return self._perms[epoch]
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perms = {e: p for e, p in self._perms.items() if e >= epoch - 1}
            self._perms[epoch] = torch.randperm(self.n, generator=gen)
        return self._perms[epoch]

    def indices(self, step: int, start: int = 0, stop: Optional[int] = None) -> torch.Tensor:
        """Rows [start, stop) of global batch `step` (default: all of it)."""
        stop = self.g if stop is None else stop
        first, last = step * self.g + start, step * self.g + stop
        parts, pos = [], first
        while pos < last:
            epoch, offset = divmod(pos, self.n)
            take = min(last - pos, self.n - offset)
            parts.append(self._perm(epoch)[offset:offset + take])
            pos += take
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def slice_for(self, step: int, replica: int, batch: int) -> torch.Tensor:
        """Replica `replica`'s rows [i·B, (i+1)·B) of global batch `step`."""
        return self.indices(step, replica * batch, (replica + 1) * batch)

    def epoch(self, step: int) -> float:
        """Epochs of the training set seen by the end of global batch `step` (0-based)."""
        return (step + 1) * self.g / self.n
