"""Models (`model=mlp|cnn|resnet18`), each an `nn.Sequential` of cuttable layers.

Sequential so that model parallelism can cut it into consecutive stages. mlp and cnn have no
BatchNorm (sync with W workers then equals one worker with W× the batch exactly); resnet18 is
torchvision's, laid out as its top-level children with a Flatten before `fc`.
"""

from __future__ import annotations

from typing import Callable

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
    import torchvision

    net = torchvision.models.resnet18(num_classes=num_classes)
    if image_shape[0] != 3:
        net.conv1 = nn.Conv2d(image_shape[0], 64, kernel_size=7, stride=2, padding=3, bias=False)
    children = dict(net.named_children())
    fc = children.pop("fc")
    return nn.Sequential(*children.values(), nn.Flatten(), fc)


MODELS: dict[str, Callable[..., nn.Sequential]] = {"mlp": mlp, "cnn": cnn, "resnet18": resnet18}


def build_model(name: str, image_shape, num_classes: int) -> nn.Sequential:
    try:
        make = MODELS[name]
    except KeyError:
        raise ValueError(f"model={name!r}: must be one of {sorted(MODELS)}") from None
    return make(tuple(image_shape), num_classes)
