"""Dense optimizers on the PS are a registry (psrpc/config.py `@optimizer`): one class each, its
fields torch.optim's keyword arguments. AdamW is one of them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from hydra.core.config_store import ConfigStore

from psrpc import config as schema
from psrpc import helptext
from psrpc.optim.dense import build_optimizer
from tests.conftest import assert_equal_model, compose, run_cluster
from tests.unit_helpers import make_shard, push, sync


def test_adamw_on_a_shard_is_torchs_adamw_bit_for_bit():
    cfg = schema.AdamWConfig(lr=0.01, weight_decay=0.1)
    shard = make_shard(sync(), cfg, workers=1, start=torch.linspace(-1, 1, 4))
    reference = torch.linspace(-1, 1, 4)
    opt = build_optimizer([reference], cfg)
    assert type(opt) is torch.optim.AdamW and opt.defaults["weight_decay"] == 0.1
    for step in range(5):
        grad = torch.tensor([0.5, -1.0, 2.0, 0.25]) * (step + 1)
        push(shard, 0, step, grad).wait()
        reference.grad = grad.clone()
        opt.step()
    assert torch.equal(shard.params, reference)


def test_an_optimizer_is_one_registered_class():
    """A new optimizer (RMSprop here) is one class: it composes as optim=<name>, with its
    defaults; --help lists and explains it; validation checks its known fields; the PS builds
    torch.optim's class from its fields."""
    @schema.optimizer
    @dataclass
    class RMSpropConfig(schema.OptimConfig):
        torch_class: ClassVar[str] = "RMSprop"
        name: str = "rmsprop"
        """torch.optim.RMSprop."""
        lr: float = 0.01
        """Learning rate."""
        alpha: float = 0.99
        """Smoothing constant."""
        eps: float = 1e-8
        """Added to the denominator."""

    try:
        cfg = compose(["optim=rmsprop"])
        assert isinstance(cfg.optim, RMSpropConfig) and cfg.optim.alpha == 0.99
        assert type(build_optimizer([torch.zeros(3)], cfg.optim)) is torch.optim.RMSprop
        text = helptext.text(["optim=rmsprop"])
        assert "rmsprop" in text and "  optim.alpha = 0.99\n      Smoothing constant." in text
        with pytest.raises(Exception, match="optim.eps"):
            compose(["optim=rmsprop", "optim.eps=nan"])
    finally:
        schema.OPTIMIZERS.pop("rmsprop")
        ConfigStore.instance().repo["optim"].pop("rmsprop.yaml")


def test_adamw_through_the_cluster_is_the_same_on_one_or_two_ps(tmp_path):
    """Elementwise: sharding the master copy over two PS changes no bit."""
    mode = ["optim=adamw", "train.steps=20", "train.log_every=10"]
    one = run_cluster(tmp_path / "one", mode)
    two = run_cluster(tmp_path / "two", mode + ["cluster.num_ps=2"])
    assert one[0]["steps"] == 20
    assert_equal_model(one[1], two[1])
