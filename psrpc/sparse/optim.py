"""Row-sparse optimizers over one local table tensor `weight (R, dim)` on a parameter server.

A step takes the unique local rows a push touched and their (summed) gradients, and updates only
those rows of the weight and of the optimizer state: an untouched row, and its state, never
change, as MXNet's lazy updates and TensorFlow's sparse `apply_*` ops behave. The per-row state
tensors (first dim R, listed in `per_row_state`) reshard by rows exactly like the weight; the rest
of `state_dict()` is scalars.

- `RowSGD`: weight[r] -= lr * (g + weight_decay * weight[r]).
- `RowWiseAdagrad`: FBGEMM's EXACT_ROWWISE_ADAGRAD (TorchRec's default for embedding tables): one
  accumulator per row, sum[r] += mean_d(g[r, d]^2), weight[r] -= lr * g[r] / (sqrt(sum[r]) + eps),
  with FBGEMM's defaults: eps = 1e-8, accumulator initialised to 0, and weight_decay as its L2 mode
  (g += weight_decay * weight[r] before the accumulator).
- `LazyAdam`: torch.optim.SparseAdam's arithmetic on the touched rows (moments of untouched rows
  are not decayed; bias correction from one step count per table, counted on every `step` call
  including those with no rows, as SparseAdam counts every `optimizer.step()`).

Contract for callers: `rows` are unique (`coalesce` first: a repeated row would lose all but one
of its updates); every shard of a table must be stepped once per round even when the round touched
none of its rows, so that LazyAdam's step count, and so its result, is the same for any number of
servers.
"""

from __future__ import annotations

import inspect
import math
from typing import Callable

import torch

from psrpc.errors import one_of


class RowOptimizer:
    """Base class: argument checks and the state_dict protocol."""

    per_row_state: tuple[str, ...] = ()  # state tensors with first dim R: reshard them by rows
    scalar_state: tuple[str, ...] = ()

    def __init__(self, weight: torch.Tensor):
        if weight.dim() != 2 or not weight.is_floating_point():
            raise ValueError(f"{type(self).__name__}: weight must be a 2-D float tensor (rows, "
                             f"dim), got {tuple(weight.shape)} {weight.dtype}")
        self.weight = weight

    checked = True  # step() checks its rows (a caller that made them itself may turn it off)

    def step(self, rows: torch.Tensor, grads: torch.Tensor, lr: float) -> None:
        raise NotImplementedError

    def initial(self, key: str) -> float:
        """The value a new row's state `key` starts from."""
        return 0.0

    def resize(self, num_rows: int) -> None:
        """The weight and the per-row state, `num_rows` rows now (a dynamic table's storage
        growing): the rows that were there keep their values, new rows are uninitialised."""
        old = self.weight
        self.weight = torch.empty(num_rows, old.shape[1], dtype=old.dtype)
        keep = min(num_rows, old.shape[0])
        self.weight[:keep] = old[:keep]
        for k in self.per_row_state:
            mine = getattr(self, k)
            grown = mine.new_empty(num_rows, *mine.shape[1:])
            grown[:keep] = mine[:keep]
            setattr(self, k, grown)

    def reset_rows(self, rows: torch.Tensor) -> None:
        """Rows made anew (a dynamic table's new ids): their state as a new optimizer's."""
        for k in self.per_row_state:
            getattr(self, k).index_fill_(0, rows, self.initial(k))

    def _check(self, rows: torch.Tensor, grads: torch.Tensor) -> None:
        if not self.checked:
            return
        num_rows, dim = self.weight.shape
        if rows.dim() != 1 or rows.dtype != torch.int64:
            raise ValueError(f"rows must be a 1-D int64 tensor, got {tuple(rows.shape)} "
                             f"{rows.dtype}")
        if grads.shape != (rows.numel(), dim) or grads.dtype != self.weight.dtype:
            raise ValueError(f"grads must be ({rows.numel()}, {dim}) {self.weight.dtype} for "
                             f"{rows.numel()} rows, got {tuple(grads.shape)} {grads.dtype}")
        if rows.numel() == 0:
            return
        if int(rows.min()) < 0 or int(rows.max()) >= num_rows:
            raise ValueError(f"rows must lie in [0, {num_rows}), got "
                             f"[{int(rows.min())}, {int(rows.max())}]")
        # ascending rows (what coalesce gives) are unique in O(U); anything else pays a sort
        if not bool((rows[1:] > rows[:-1]).all()) and torch.unique(rows).numel() != rows.numel():
            raise ValueError("rows must be unique: coalesce duplicate ids before the step")

    def state_dict(self) -> dict:
        state = {k: getattr(self, k) for k in self.per_row_state}
        state.update({k: getattr(self, k) for k in self.scalar_state})
        return state

    def load_state_dict(self, state: dict) -> None:
        expected = set(self.per_row_state) | set(self.scalar_state)
        if set(state) != expected:
            raise ValueError(f"{type(self).__name__}.load_state_dict: keys {sorted(state)}, "
                             f"expected {sorted(expected)}")
        for k in self.per_row_state:
            mine = getattr(self, k)
            if state[k].shape != mine.shape:
                raise ValueError(f"{type(self).__name__}.load_state_dict: {k} has shape "
                                 f"{tuple(state[k].shape)}, expected {tuple(mine.shape)}")
            mine.copy_(state[k])
        for k in self.scalar_state:
            setattr(self, k, type(getattr(self, k))(state[k]))


class RowSGD(RowOptimizer):
    def __init__(self, weight: torch.Tensor, weight_decay: float = 0.0):
        super().__init__(weight)
        self.weight_decay = weight_decay

    def step(self, rows, grads, lr):
        self._check(rows, grads)
        if self.weight_decay:
            grads = grads.add(self.weight.index_select(0, rows), alpha=self.weight_decay)
        self.weight.index_add_(0, rows, grads, alpha=-lr)


class RowWiseAdagrad(RowOptimizer):
    per_row_state = ("sum",)  # (R,) float32: the running sum of mean squared row gradients

    def __init__(self, weight: torch.Tensor, eps: float = 1e-8, weight_decay: float = 0.0,
                 initial_accumulator_value: float = 0.0):
        super().__init__(weight)
        self.eps, self.weight_decay = eps, weight_decay
        self.initial_accumulator_value = initial_accumulator_value
        self.sum = torch.full((weight.shape[0],), initial_accumulator_value, dtype=torch.float32)

    def initial(self, key: str) -> float:
        return self.initial_accumulator_value

    def step(self, rows, grads, lr):
        self._check(rows, grads)
        if rows.numel() == 0:
            return
        if self.weight_decay:
            grads = grads.add(self.weight.index_select(0, rows), alpha=self.weight_decay)
        acc = self.sum.index_select(0, rows).add_(grads.float().square().mean(1))
        self.sum.index_copy_(0, rows, acc)
        multiplier = acc.sqrt_().add_(self.eps).reciprocal_().mul_(-lr)  # -lr / (sqrt + eps)
        self.weight.index_add_(0, rows, grads * multiplier.to(grads.dtype).unsqueeze(1))


class LazyAdam(RowOptimizer):
    per_row_state = ("exp_avg", "exp_avg_sq")  # (R, dim) each, like the weight
    scalar_state = ("step_count",)  # steps taken by this table, for the bias correction

    def __init__(self, weight: torch.Tensor, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8):
        super().__init__(weight)
        self.beta1, self.beta2 = betas
        self.eps = eps
        self.exp_avg = torch.zeros_like(weight)
        self.exp_avg_sq = torch.zeros_like(weight)
        self.step_count = 0

    def step(self, rows, grads, lr):
        """torch.optim.SparseAdam's arithmetic, operation for operation, on the given rows."""
        self._check(rows, grads)
        self.step_count += 1
        if rows.numel() == 0:
            return
        old_avg = self.exp_avg.index_select(0, rows)
        old_avg_sq = self.exp_avg_sq.index_select(0, rows)
        avg_update = grads.sub(old_avg).mul_(1 - self.beta1)
        avg_sq_update = grads.pow(2).sub_(old_avg_sq).mul_(1 - self.beta2)
        numer = avg_update.add_(old_avg)  # the new first moment of these rows
        new_avg_sq = avg_sq_update.add_(old_avg_sq)
        self.exp_avg.index_copy_(0, rows, numer)
        self.exp_avg_sq.index_copy_(0, rows, new_avg_sq)
        denom = new_avg_sq.sqrt().add_(self.eps)
        bias_correction1 = 1 - self.beta1 ** self.step_count
        bias_correction2 = 1 - self.beta2 ** self.step_count
        step_size = lr * math.sqrt(bias_correction2) / bias_correction1
        self.weight.index_add_(0, rows, numer.div_(denom).mul_(-step_size))


SPARSE_OPTIMIZERS: dict[str, Callable[..., RowOptimizer]] = {
    "sgd": RowSGD,
    "adagrad": RowWiseAdagrad,
    "adam": LazyAdam,
}


def build_sparse_optimizer(name: str, weight: torch.Tensor, **hyper) -> RowOptimizer:
    """`SPARSE_OPTIMIZERS[name](weight, **hyper)`; an unknown name or hyperparameter is an error
    that lists what is valid."""
    cls = one_of(SPARSE_OPTIMIZERS, name, "sparse.optimizer")
    try:
        return cls(weight, **hyper)
    except TypeError as e:
        valid = [p for p in inspect.signature(cls).parameters if p != "weight"]
        raise ValueError(f"sparse optimizer {name!r}: {e}; its hyperparameters are "
                         f"{valid}") from None


def sparse_hyper(sparse) -> dict:
    """The row optimizer's hyperparameters from the sparse config."""
    if sparse.optimizer == "sgd":
        return {"weight_decay": sparse.weight_decay}
    if sparse.optimizer == "adagrad":
        return {"eps": sparse.eps, "weight_decay": sparse.weight_decay}
    return {"betas": tuple(sparse.betas), "eps": sparse.eps}
