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

`check_run` is the check before any process starts: the targets import, their arguments fit
their signatures, the data builds, and a batch of two goes through the model, the loss and the
metric; any failure is one line naming the key.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch.utils.data import Dataset, default_collate

from psrpc.errors import ConfigError, first_line

RESERVED = {"data": ("num_workers",)}
"""Keys of a node that are psrpc's, not the factory's (data.num_workers: loader processes)."""


@dataclass
class Data:
    train: Dataset
    test: Optional[Dataset]
    info: dict = field(default_factory=dict)  # handed to the other factories by name


def locate(key: str, node: Any) -> Callable:
    """The callable `node['_target_']` names; a clear error when it is missing or does not import."""
    from hydra.utils import get_object

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


def check_arguments(key: str, node: dict, context: Optional[dict] = None) -> None:
    """The config's arguments fit the factory's signature; with the `context` it will get,
    every parameter without a default is given."""
    fn = locate(key, node)
    args = arguments(key, node)
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: trust it
        return
    takes_any = any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values())
    unknown = [k for k in args if k not in sig.parameters and not takes_any]
    if unknown:
        takes = [n for n, p in sig.parameters.items()
                 if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        raise ConfigError(
            f"{key}.{unknown[0]}: {node['_target_']}() takes no argument {unknown[0]!r} (it "
            f"takes: {', '.join(takes) or 'nothing'}). Keys set for another {key} stay when "
            f"only {key}._target_ changes: start from {key}=custom, or write a config of your "
            "own (docs/own-model.md)")
    if context is None:  # before the data is built: what it passes is not known yet
        return
    given = {**_injected(sig, args, context), **args}
    missing = [n for n, p in sig.parameters.items()
               if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
               and n not in given]
    if missing:
        raise ConfigError(f"{key}: {node['_target_']}() needs {missing[0]!r}: set "
                          f"+{key}.{missing[0]}=... (or return it from the dataset factory)")


def _injected(sig: inspect.Signature, args: dict, context: dict) -> dict:
    """The context entries the factory asks for by name and the config does not set."""
    return {k: v for k, v in context.items() if k in sig.parameters and k not in args}


def instantiate(key: str, node: dict, context: dict = {}) -> Any:
    """Call the factory with the config's arguments plus the context it asks for."""
    from hydra.utils import instantiate as hydra_instantiate

    fn = locate(key, node)
    args = arguments(key, node)
    try:
        extra = _injected(inspect.signature(fn), args, context)
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
    from psrpc.sparse import tables

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


def check_run(cfg) -> None:
    """Before any process starts: build what every rank will build and put a batch of two
    through it, so that a wrong shape is one clear line here, not a traceback on every rank."""
    check_arguments("data", cfg.data, {"seed": cfg.train.seed})
    data = load_data(cfg)
    for key in ("model", "loss", "metric"):
        check_arguments(key, getattr(cfg, key), data.info)
    model, loss_fn, metric = build_model(cfg, data), build_loss(cfg, data), build_metric(cfg, data)
    from psrpc.sparse.tables import DryRows
    from psrpc.sparse.tables import find_tables

    tables = find_tables(model)
    for t in tables:
        t.bind(DryRows(t.specs))  # no server to ask yet: zeros, the shapes are what matter
    names = [s.name for t in tables for s in t.specs]
    if len(set(names)) != len(names):
        raise ConfigError(f"model._target_={cfg.model['_target_']!r}: embedding table names "
                          f"must be unique across the model, got {names}")
    if tables and cfg.parallel.name == "model":
        raise ConfigError("parallel=model with embedding tables: tables live on the PS and are "
                          "looked up by data-parallel workers; use parallel=data")
    try:
        x, y = default_collate([data.train[i] for i in range(min(2, len(data.train)))])
    except Exception as e:
        raise ConfigError(f"data._target_={cfg.data['_target_']!r}: its items do not make a "
                          f"batch ({first_line(e)}); an item is an (input, target) pair of "
                          "tensors (or dicts of tensors)") from None
    try:
        with torch.no_grad():
            out = model(x)
    except Exception as e:
        raise ConfigError(f"model._target_={cfg.model['_target_']!r} cannot take a batch of "
                          f"data._target_={cfg.data['_target_']!r}: {first_line(e)} (input "
                          f"{_shape(x)})") from None
    try:
        value = loss_fn(out, y)
        if not (isinstance(value, torch.Tensor) and value.numel() == 1):
            raise ValueError(f"it returned {_shape(value)}, expected a scalar tensor")
    except Exception as e:
        raise ConfigError(f"loss._target_={cfg.loss['_target_']!r} on the model's output "
                          f"{_shape(out)} and the target {_shape(y)}: {first_line(e)}") from None
    try:
        metric.reset()
        metric.update(out, y)
        metric.compute()
    except Exception as e:
        raise ConfigError(f"metric._target_={cfg.metric['_target_']!r} on the model's output "
                          f"{_shape(out)} and the target {_shape(y)}: {first_line(e)}") from None
    if cfg.parallel.name == "model":
        from psrpc.models.stages import model_cuts

        model_cuts(model, cfg.parallel)  # the model can be cut as asked


def _shape(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"{tuple(x.shape)} {str(x.dtype).replace('torch.', '')}"
    if isinstance(x, dict):
        return "{" + ", ".join(f"{k}: {_shape(v)}" for k, v in x.items()) + "}"
    if isinstance(x, (tuple, list)):
        return "(" + ", ".join(_shape(v) for v in x) + ")"
    return type(x).__name__
