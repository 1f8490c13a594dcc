"""The built-in dataset factories (`data=synthetic|mnist|cifar10`), and the global batch order.

The built-ins are whole normalised tensors in memory (a TensorDataset, indexed a batch at a time:
no per-sample Python), returned as `{"train", "test", "image_shape", "num_classes"}` like any
dataset factory (psrpc/factories.py).

Determinism: the global batch at step t is rows [t·G, (t+1)·G) of an endless stream of per-epoch
permutations seeded by train.seed, with G = replicas × batch; replica i takes rows [i·B, (i+1)·B)
of it. So it is the same set of samples whatever the number of workers, for any map-style
dataset.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from psrpc.errors import ConfigError


def _check(ok: bool, key: str, value, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"data.{key}={value!r}: {allowed}")


def synthetic(image_shape=(1, 28, 28), num_classes: int = 10, size: int = 16384,
              test_size: int = 2048, noise: float = 5.0, seed: int = 0) -> dict:
    """Class prototypes (smooth random images) plus Gaussian noise: learnable, not trivial,
    deterministic from the seed."""
    _check(len(image_shape) == 3 and all(n >= 1 for n in image_shape), "image_shape",
           list(image_shape), "must be [C, H, W] with every entry ≥ 1")
    _check(num_classes >= 2, "num_classes", num_classes, "must be ≥ 2")
    _check(size >= 1, "size", size, "must be ≥ 1")
    _check(test_size >= 0, "test_size", test_size, "must be ≥ 0")
    _check(noise >= 0, "noise", noise, "must be ≥ 0")
    c, h, w = image_shape
    g = torch.Generator().manual_seed(seed)
    coarse = torch.randn(num_classes, c, max(1, h // 4), max(1, w // 4), generator=g)
    protos = F.interpolate(coarse, size=(h, w), mode="bilinear", align_corners=False)
    scale = float((protos.var() + noise ** 2) ** 0.5)

    def draw(n: int) -> TensorDataset:
        y = torch.randint(num_classes, (n,), generator=g)
        x = protos[y] + noise * torch.randn(n, c, h, w, generator=g)
        return TensorDataset(x.div_(scale), y)  # roughly unit variance, like normalised images

    train = draw(size)
    return {"train": train, "test": draw(test_size) if test_size else None,
            "image_shape": (c, h, w), "num_classes": num_classes}


# Files torchvision needs (its check_exists), so a wrong data.root is one clear line.
_FILES = {
    "MNIST": ["MNIST/raw/train-images-idx3-ubyte", "MNIST/raw/train-labels-idx1-ubyte",
              "MNIST/raw/t10k-images-idx3-ubyte", "MNIST/raw/t10k-labels-idx1-ubyte"],
    "CIFAR10": [f"cifar-10-batches-py/{f}" for f in
                ["batches.meta", "test_batch"] + [f"data_batch_{i}" for i in range(1, 6)]],
}


def _torchvision(cls_name: str, root: str, download: bool, mean, std) -> dict:
    """A torchvision dataset as whole normalised tensors (indexed a batch at a time)."""
    import torchvision

    missing = [f for f in _FILES[cls_name] if not (Path(root) / f).is_file()]
    if missing and not download:
        raise ConfigError(
            f"data.root={root!r}: {cls_name.lower()} not found (missing {Path(root) / missing[0]}). "
            "Point data.root at the folder in torchvision's layout that holds it, or set "
            "data.download=true")
    cls = getattr(torchvision.datasets, cls_name)
    splits = []
    for train in (True, False):
        ds = cls(root, train=train, download=download)
        x = torch.as_tensor(ds.data)
        x = x.unsqueeze(1) if x.dim() == 3 else x.permute(0, 3, 1, 2)  # -> N, C, H, W
        x = x.float().div_(255)
        m, s = torch.tensor(mean).view(1, -1, 1, 1), torch.tensor(std).view(1, -1, 1, 1)
        splits.append(TensorDataset(x.sub_(m).div_(s),
                                    torch.as_tensor(ds.targets, dtype=torch.int64)))
    return {"train": splits[0], "test": splits[1],
            "image_shape": tuple(splits[0].tensors[0].shape[1:]), "num_classes": 10}


def mnist(root: str, download: bool = False) -> dict:
    """MNIST through torchvision (root holds MNIST/raw/), normalised."""
    return _torchvision("MNIST", root, download, [0.1307], [0.3081])


def cifar10(root: str, download: bool = False) -> dict:
    """CIFAR-10 through torchvision (root holds cifar-10-batches-py/), normalised, no
    augmentation (examples/cifar_cnn.py shows a dataset factory that augments)."""
    return _torchvision("CIFAR10", root, download, [0.4914, 0.4822, 0.4465],
                        [0.2470, 0.2435, 0.2616])


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

    def epoch(self, step: int) -> float:
        """Epochs of the training set seen by the end of global batch `step` (0-based)."""
        return (step + 1) * self.g / self.n
