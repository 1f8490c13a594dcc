"""Models: the built-in ones (`model=mlp|cnn|resnet18`, psrpc/models/vision.py; the DLRM is
psrpc/recsys/dlrm.py) and how any model is cut into pipeline stages (psrpc/models/stages.py).
Leaves: nothing here talks to another process."""

from psrpc.models.vision import cnn, mlp, resnet18

__all__ = ["cnn", "mlp", "resnet18"]
