"""Cutting a model into pipeline stages (`parallel=model`): which layers, where to cut, and a
stage as a module of its own. Pure model surgery, no RPC: the chief plans the cuts, each stage
worker builds its stage (psrpc/worker/pipeline.py), and the pre-start check tries them.
"""

from __future__ import annotations

from typing import Optional

from torch import nn

from psrpc.errors import ConfigError


def pipeline_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The layers stages are cut between, in forward order, with their names in the model: an
    nn.Sequential's children, or what the model's `pipeline_layers()` lists (its forward must
    be those layers applied one after another)."""
    if isinstance(model, nn.Sequential):
        return [(str(i), m) for i, m in enumerate(model)]
    listed = getattr(model, "pipeline_layers", None)
    if not callable(listed):
        raise ConfigError(
            f"parallel=model cuts the model into stages of consecutive layers: it must be an "
            f"nn.Sequential, or define pipeline_layers() returning its layers in forward order; "
            f"{type(model).__name__} is neither")
    names = {id(m): n for n, m in model.named_modules() if n}
    layers = list(listed())
    unknown = [type(m).__name__ for m in layers if id(m) not in names]
    if unknown or not layers:
        raise ConfigError(f"{type(model).__name__}.pipeline_layers() must list submodules of "
                          f"the model (got {unknown[0] if unknown else 'none'})")
    return [(names[id(m)], m) for m in layers]


class StageModule(nn.Module):
    """Consecutive layers of a model, registered under their names in the whole model (so
    parameters and buffers are named as in model.pt); forward runs them in order."""

    def __init__(self, layers: list[tuple[str, nn.Module]]):
        super().__init__()
        self._order: list[nn.Module] = [m for _, m in layers]
        for path, module in layers:
            parent = self
            *outer, last = path.split(".")
            for part in outer:  # empty containers mirroring the model's nesting
                if not hasattr(parent, part):
                    parent.add_module(part, nn.Module())
                parent = getattr(parent, part)
            parent.add_module(last, module)

    def forward(self, x):
        for layer in self._order:
            x = layer(x)
        return x


def cut_points(layers: list[nn.Module], stages: int, split: Optional[list[int]] = None) -> list[int]:
    """Index of the first layer of each stage. Every stage holds at least one layer with
    parameters; by default the cuts minimise the largest stage's parameter count."""
    sizes = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    holders = [i for i, n in enumerate(sizes) if n]
    if stages > len(holders):
        raise ConfigError(f"parallel.stages={stages}: the model has only {len(holders)} layers "
                          f"with parameters to cut between ({len(layers)} layers in all); use at "
                          f"most {len(holders)} stages")
    if split is not None:
        cuts = [0] + list(split)
        bounds = cuts + [len(layers)]
        ok = (len(split) == stages - 1 and all(a < b for a, b in zip(bounds, bounds[1:]))
              and all(any(sizes[a:b]) for a, b in zip(bounds, bounds[1:])))
        if not ok:
            raise ConfigError(
                f"parallel.split={list(split)}: need {stages - 1} increasing layer indices in "
                f"1..{len(layers) - 1} so that every stage has parameters (layer sizes: {sizes})")
        return cuts
    # Balanced: try every way to put the S-1 cuts just before a parameter-holding layer.
    best: tuple[float, list[int]] = (float("inf"), [])

    def search(start_holder: int, left: int, cuts: list[int]) -> None:
        nonlocal best
        if left == 0:
            bounds = cuts + [len(layers)]
            worst = max(sum(sizes[a:b]) for a, b in zip(bounds, bounds[1:]))
            best = min(best, (worst, list(cuts)))
            return
        for h in range(start_holder, len(holders) - left + 1):
            search(h + 1, left - 1, cuts + [holders[h]])

    search(1, stages - 1, [0])
    return best[1]


def model_cuts(model: nn.Module, parallel) -> list[int]:
    """The cuts `parallel` (the model-parallel config: stages, split) asks of `model`."""
    return cut_points([m for _, m in pipeline_layers(model)], parallel.stages, parallel.split)


def stage_module(model: nn.Module, cuts: list[int], stage: int) -> StageModule:
    """Stage `stage`'s layers, named as in the whole model."""
    layers = pipeline_layers(model)
    end = cuts[stage + 1] if stage + 1 < len(cuts) else len(layers)
    return StageModule(layers[cuts[stage]:end])


def stage_shapes(model: nn.Module, cuts: list[int]) -> list[dict[str, tuple]]:
    return [{n: tuple(p.shape) for n, p in stage_module(model, cuts, s).named_parameters()}
            for s in range(len(cuts))]


# -- one stage, on its worker -------------------------------------------------------------------
