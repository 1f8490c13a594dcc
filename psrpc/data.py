"""Datasets (`data=synthetic|mnist|cifar10`) held as whole tensors, and the global batch order.

Whole normalised tensors in memory, indexed by batch: no per-sample Python, no DataLoader
workers competing for the cores. No augmentation.

Determinism (DESIGN §4): the global batch at step t is rows [t·G, (t+1)·G) of an endless stream of
per-epoch permutations seeded by train.seed, with G = replicas × batch; replica i takes rows
[i·B, (i+1)·B) of it. So it is the same set of samples whatever the number of workers.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F


@dataclass
class Split:
    x: torch.Tensor  # (N, C, H, W) float32, normalised
    y: torch.Tensor  # (N,) int64

    def __len__(self) -> int:
        return len(self.y)


@dataclass
class Dataset:
    train: Split
    test: Optional[Split]
    image_shape: tuple[int, int, int]
    num_classes: int


def _synthetic(cfg, seed: int) -> Dataset:
    """Class prototypes (smooth random images) plus Gaussian noise: learnable, not trivial."""
    c, h, w = cfg.image_shape
    g = torch.Generator().manual_seed(seed)
    coarse = torch.randn(cfg.num_classes, c, max(1, h // 4), max(1, w // 4), generator=g)
    protos = F.interpolate(coarse, size=(h, w), mode="bilinear", align_corners=False)
    scale = float((protos.var() + cfg.noise ** 2) ** 0.5)

    def draw(n: int) -> Split:
        y = torch.randint(cfg.num_classes, (n,), generator=g)
        x = protos[y] + cfg.noise * torch.randn(n, c, h, w, generator=g)
        return Split(x.div_(scale), y)  # roughly unit variance, like normalised images

    train = draw(cfg.size)
    test = draw(cfg.test_size) if cfg.test_size else None
    return Dataset(train, test, (c, h, w), cfg.num_classes)


def _torchvision(cls_name: str, mean, std) -> Callable:
    def load(cfg, seed: int) -> Dataset:
        import torchvision

        cls = getattr(torchvision.datasets, cls_name)
        splits = []
        for train in (True, False):
            ds = cls(cfg.root, train=train, download=cfg.download)
            x = torch.as_tensor(ds.data)
            x = x.unsqueeze(1) if x.dim() == 3 else x.permute(0, 3, 1, 2)  # -> N, C, H, W
            x = x.float().div_(255)
            m = torch.tensor(mean).view(1, -1, 1, 1)
            s = torch.tensor(std).view(1, -1, 1, 1)
            splits.append(Split(x.sub_(m).div_(s), torch.as_tensor(ds.targets, dtype=torch.int64)))
        return Dataset(splits[0], splits[1], tuple(splits[0].x.shape[1:]), 10)

    return load


DATASETS: dict[str, Callable] = {
    "synthetic": _synthetic,
    "mnist": _torchvision("MNIST", [0.1307], [0.3081]),
    "cifar10": _torchvision("CIFAR10", [0.4914, 0.4822, 0.4465], [0.2470, 0.2435, 0.2616]),
}

# Files torchvision needs (its check_exists), so a wrong data.root fails before any process starts.
_FILES = {
    "mnist": ["MNIST/raw/train-images-idx3-ubyte", "MNIST/raw/train-labels-idx1-ubyte",
              "MNIST/raw/t10k-images-idx3-ubyte", "MNIST/raw/t10k-labels-idx1-ubyte"],
    "cifar10": [f"cifar-10-batches-py/{f}" for f in
                ["batches.meta", "test_batch"] + [f"data_batch_{i}" for i in range(1, 6)]],
}


def data_shape(cfg) -> tuple[tuple[int, int, int], int]:
    """(image_shape, num_classes) of a dataset config, without loading anything."""
    if cfg.name == "synthetic":
        return tuple(cfg.image_shape), cfg.num_classes
    return {"mnist": ((1, 28, 28), 10), "cifar10": ((3, 32, 32), 10)}[cfg.name]


def missing_files(name: str, root: Path) -> list[str]:
    """Files of dataset `name` absent under `root` (empty when all are there)."""
    return [str(root / f) for f in _FILES.get(name, []) if not (root / f).is_file()]


def load_dataset(cfg, seed: int) -> Dataset:
    try:
        load = DATASETS[cfg.name]
    except KeyError:
        raise ValueError(f"data={cfg.name!r}: must be one of {sorted(DATASETS)}") from None
    return load(cfg, seed)


class GlobalBatches:
    """Which samples make the global batch at each step."""

    def __init__(self, num_samples: int, global_batch: int, seed: int):
        self.n, self.g, self.seed = num_samples, global_batch, seed
        self._perms: dict[int, torch.Tensor] = {}

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
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
