"""The built-in dataset factories (`data=synthetic|mnist|cifar10`).

The built-ins are whole normalised tensors in memory (a TensorDataset, indexed a batch at a time:
no per-sample Python), returned as `{"train", "test", "image_shape", "num_classes"}` like any
dataset factory (psrpc/factories.py).

Which samples each step trains on is psrpc/worker/batches.py (the batch order contract).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from psrpc.errors import ConfigError, require


def synthetic(image_shape=(1, 28, 28), num_classes: int = 10, size: int = 16384,
              test_size: int = 2048, noise: float = 5.0, seed: int = 0) -> dict:
    """Class prototypes (smooth random images) plus Gaussian noise: learnable, not trivial,
    deterministic from the seed."""
    require(len(image_shape) == 3 and all(n >= 1 for n in image_shape), "data.image_shape",
           list(image_shape), "must be [C, H, W] with every entry ≥ 1")
    require(num_classes >= 2, "data.num_classes", num_classes, "must be ≥ 2")
    require(size >= 1, "data.size", size, "must be ≥ 1")
    require(test_size >= 0, "data.test_size", test_size, "must be ≥ 0")
    require(noise >= 0, "data.noise", noise, "must be ≥ 0")
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
    import torchvision  # deferred: ~1 s to import, and only these datasets need it

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
