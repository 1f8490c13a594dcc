"""The user's model, data, loss and metric, built from import paths (Hydra's `_target_`).

    model:  {_target_: my.pkg.make_net, hidden: 128}      -> nn.Module
    data:   {_target_: my.pkg.make_datasets, path: x.txt} -> {"train": ds, "test": ds, **info}
    loss:   {_target_: torch.nn.CrossEntropyLoss}         -> loss(output, target), a batch mean
    metric: {_target_: psrpc.metrics.Accuracy}            -> update / compute / reset

Every process builds its own copy from the import path: nothing live crosses a process
boundary. What a dataset factory returns beside its splits (`info`: e.g. `num_classes`,
`image_shape`, `tables`) is passed to the model, loss and metric factories by name, to the
parameters that ask for it and are not set in the config; `seed` (train.seed) likewise to a
data factory. The built-in models and datasets are factories of the same kind (conf/model,
conf/data): examples of the contract, not special cases.

Before any process starts, psrpc/validate.py checks that the targets import, their arguments
fit their signatures, the data builds, and a batch of two goes through the model, the loss and
the metric; any failure is one line naming the key.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from hydra.utils import get_object
from hydra.utils import instantiate as hydra_instantiate
from torch.utils.data import Dataset

from psrpc.errors import ConfigError, first_line
from psrpc.sparse import tables

RESERVED = {"data": ("num_workers",)}
"""Keys of a node that are psrpc's, not the factory's (data.num_workers: loader processes)."""


@dataclass
class Data:
    train: Dataset
    test: Optional[Dataset]
    info: dict = field(default_factory=dict)  # handed to the other factories by name


def locate(key: str, node: Any) -> Callable:
    """The callable `node['_target_']` names; a clear error when it is missing or does not import."""
    if not isinstance(node, dict) or not isinstance(node.get("_target_"), str):
        raise ConfigError(f"{key}: needs `_target_`, the import path of a factory "
                          f"(e.g. {key}._target_=my.pkg.make_{key}); got {node!r}")
    target = node["_target_"]
    try:
        fn = get_object(target)
    except Exception as e:
        first = first_line(e)
        raise ConfigError(f"{key}._target_={target!r} does not import: {first}") from None
    if not callable(fn):
        raise ConfigError(f"{key}._target_={target!r} is a {type(fn).__name__}, not callable")
    return fn


def arguments(key: str, node: dict) -> dict:
    return {k: v for k, v in node.items() if k != "_target_" and k not in RESERVED.get(key, ())}


def injected(sig: inspect.Signature, args: dict, context: dict) -> dict:
    """The context entries the factory asks for by name and the config does not set."""
    return {k: v for k, v in context.items() if k in sig.parameters and k not in args}


def instantiate(key: str, node: dict, context: dict = {}) -> Any:
    """Call the factory with the config's arguments plus the context it asks for."""
    fn = locate(key, node)
    args = arguments(key, node)
    try:
        extra = injected(inspect.signature(fn), args, context)
    except (TypeError, ValueError):
        extra = {}
    # Hydra builds the config's arguments (nested `_target_`s too); the context, which may
    # hold any Python object, is passed by the call itself.
    partial = hydra_instantiate({"_target_": node["_target_"], **args}, _partial_=True,
                                _convert_="all")
    return partial(**extra)


def load_data(cfg) -> Data:
    """The datasets, seeded by train.seed: `{"train", "test", **info}` from the factory (a
    (train, test) pair or a bare train dataset are accepted too)."""
    out = instantiate("data", cfg.data, {"seed": cfg.train.seed})
    if isinstance(out, dict):
        if "train" not in out:
            raise ConfigError(f"data._target_={cfg.data['_target_']!r} returned a dict without "
                              "'train' (expected {'train': ..., 'test': ..., **info})")
        info = {k: v for k, v in out.items() if k not in ("train", "test")}
        data = Data(out["train"], out.get("test"), info)
    elif isinstance(out, (tuple, list)) and len(out) in (1, 2):
        data = Data(out[0], out[1] if len(out) == 2 else None)
    else:
        data = Data(out, None)
    for split in ("train", "test"):
        ds = getattr(data, split)
        if ds is not None and not (hasattr(ds, "__getitem__") and hasattr(ds, "__len__")):
            raise ConfigError(f"data._target_={cfg.data['_target_']!r}: its {split} split is a "
                              f"{type(ds).__name__}, not a map-style dataset (__getitem__ and "
                              "__len__)")
    if len(data.train) == 0:
        raise ConfigError(f"data._target_={cfg.data['_target_']!r}: the train split is empty")
    return data


def build_model(cfg, data: Data, remote_tables: bool = True) -> torch.nn.Module:
    """The model; its embedding tables (psrpc.sparse.EmbeddingTables) hold no rows unless
    `remote_tables` is False (a peer outside psrpc): psrpc keeps them on the PS."""
    sp = cfg.sparse
    with tables.table_options(sp.dynamic, sp.hash_size):  # every table, if the config says
        if remote_tables:
            with tables.remote_tables():
                model = instantiate("model", cfg.model, data.info)
        else:
            model = instantiate("model", cfg.model, data.info)
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"model._target_={cfg.model['_target_']!r} returned a "
                          f"{type(model).__name__}, not a torch.nn.Module")
    return model


def build_loss(cfg, data: Data) -> Callable:
    return instantiate("loss", cfg.loss, data.info)


def build_metric(cfg, data: Data):
    metric = instantiate("metric", cfg.metric, data.info)
    for attr in ("update", "compute", "reset"):
        if not callable(getattr(metric, attr, None)):
            raise ConfigError(f"metric._target_={cfg.metric['_target_']!r}: has no {attr}(); a "
                              "metric needs update(output, target), compute() and reset()")
    return metric


def metric_name(metric) -> str:
    return str(getattr(metric, "name", type(metric).__name__.lower()))
