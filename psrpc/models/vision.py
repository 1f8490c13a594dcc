"""The built-in model factories (`model=mlp|cnn|resnet18`), each an `nn.Sequential` of
cuttable layers, built from the config like any user model (psrpc/factories.py): `image_shape`
and `num_classes` come from the dataset.

Sequential so that model parallelism can cut it into consecutive stages. mlp and cnn have no
BatchNorm (sync with W workers then equals one worker with W× the batch exactly); resnet18 is
torchvision's, laid out as its top-level children with a Flatten before `fc`.
"""

from __future__ import annotations

from torch import nn


def mlp(image_shape, num_classes: int, hidden: int = 256) -> nn.Sequential:
    c, h, w = image_shape
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(c * h * w, hidden), nn.ReLU(),
        nn.Linear(hidden, hidden), nn.ReLU(),
        nn.Linear(hidden, num_classes),
    )


def cnn(image_shape, num_classes: int) -> nn.Sequential:
    c, h, w = image_shape
    return nn.Sequential(
        nn.Conv2d(c, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64 * (h // 4) * (w // 4), 128), nn.ReLU(),
        nn.Linear(128, num_classes),
    )


def resnet18(image_shape, num_classes: int) -> nn.Sequential:
    import torchvision  # deferred: ~1 s to import, and only resnet18 needs it

    net = torchvision.models.resnet18(num_classes=num_classes)
    if image_shape[0] != 3:
        net.conv1 = nn.Conv2d(image_shape[0], 64, kernel_size=7, stride=2, padding=3, bias=False)
    children = dict(net.named_children())
    fc = children.pop("fc")
    return nn.Sequential(*children.values(), nn.Flatten(), fc)
