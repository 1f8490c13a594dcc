"""A user CNN on CIFAR-10-style data, with the usual augmentation (random crop with 4 pixels of
padding, horizontal flip) done by the dataset factory, per sample.

    python -m psrpc -cd examples/conf +experiment=cifar_cnn                    # CIFAR-10-shaped synthetic data
    python -m psrpc -cd examples/conf +experiment=cifar_cnn data.root=/data     # real CIFAR-10 (torchvision layout)
    python -m psrpc -cd examples/conf +experiment=cifar_cnn data.num_workers=2  # decode in 2 background processes

psrpc seeds each sample's augmentation from (train.seed, epoch, sample index), so the same
sample gets the same crop and flip whatever the number of workers or loader processes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

MEAN = torch.tensor([0.4914, 0.4822, 0.4465]).view(3, 1, 1)
STD = torch.tensor([0.2470, 0.2435, 0.2616]).view(3, 1, 1)


class Augmented(Dataset):
    """uint8 images (N, 3, 32, 32) and labels; item i: normalised, cropped and flipped."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, augment: bool):
        self.images, self.labels, self.augment = images, labels, augment

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        x = self.images[i].float().div_(255).sub_(MEAN).div_(STD)
        if self.augment:
            x = F.pad(x, (4, 4, 4, 4))
            top, left = torch.randint(0, 9, (2,)).tolist()
            x = x[:, top:top + 32, left:left + 32]
            if torch.rand(()) < 0.5:
                x = x.flip(2)
        return x, self.labels[i]


def _cifar10(root: str):
    import torchvision

    out = []
    for train in (True, False):
        ds = torchvision.datasets.CIFAR10(root, train=train, download=False)
        out.append((torch.as_tensor(ds.data).permute(0, 3, 1, 2).contiguous(),
                    torch.as_tensor(ds.targets)))
    return out


def _synthetic(size: int, test_size: int, seed: int):
    """Ten smooth colour prototypes plus noise, as uint8 32×32 images: learnable, CIFAR-shaped."""
    g = torch.Generator().manual_seed(seed)
    protos = F.interpolate(torch.rand(10, 3, 8, 8, generator=g), size=(32, 32),
                           mode="bilinear", align_corners=False)

    def draw(n: int):
        y = torch.randint(10, (n,), generator=g)
        x = (protos[y] + 0.25 * torch.randn(n, 3, 32, 32, generator=g)).clamp(0, 1)
        return x.mul(255).to(torch.uint8), y

    return draw(size), draw(test_size)


def make_datasets(root: Optional[str] = None, size: int = 10000, test_size: int = 1000,
                  seed: int = 0):
    """Real CIFAR-10 when `root` holds it (torchvision's cifar-10-batches-py/), else synthetic."""
    if root is not None:
        if not (Path(root) / "cifar-10-batches-py").is_dir():
            raise ValueError(f"data.root={root!r} holds no cifar-10-batches-py/; leave data.root "
                             "unset for CIFAR-shaped synthetic data")
        (xtr, ytr), (xte, yte) = _cifar10(root)
    else:
        (xtr, ytr), (xte, yte) = _synthetic(size, test_size, seed)
    return {"train": Augmented(xtr, ytr, augment=True),
            "test": Augmented(xte, yte, augment=False), "num_classes": 10}


def make_model(num_classes: int, width: int = 32) -> nn.Module:
    w = width
    return nn.Sequential(
        nn.Conv2d(3, w, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(w, 2 * w, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(2 * w, 4 * w, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Linear(4 * w, num_classes))
