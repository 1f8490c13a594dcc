"""One rank of a peer system (DDP, TorchRec) started by torchrun on an emulated host, for
benchmarks/links.py: the same rank functions as the one-host benchmarks (same model, data,
batches, optimizers), their gloo group where torchrun says, and the host's interface counters
read as the clock starts and after the last step.

    torchrun ... -m benchmarks.link_peer SYSTEM OUT_JSON THREADS [psrpc overrides...]

SYSTEM: ddp_sparse or torchrec (a DLRM config), ddp or ddp_fp16 (DDP with its fp16
compression hook). Rank 0 writes OUT_JSON: samples/s and the bytes its host's eth1 sent and
received per timed step.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from psrpc.hooks import Hook

IFACE = Path("/sys/class/net/eth1/statistics")  # the emulated host's one interface


def iface_bytes() -> dict[str, int]:
    """What this host's eth1 sent and received so far (zeros where there is none)."""
    if not IFACE.exists():
        return {"tx_bytes": 0, "rx_bytes": 0}
    return {k: int((IFACE / k).read_text()) for k in ("tx_bytes", "rx_bytes")}


class _Out:
    """The `out` queue the rank functions put their result in: a JSON file, with the
    interface's bytes per timed step."""

    def __init__(self, path: str):
        self.path, self.marks = Path(path), {}

    def mark(self, step: int) -> None:
        self.marks[step] = iface_bytes()

    def put(self, result: dict) -> None:
        (start, a), (end, b) = sorted(self.marks.items())[0], sorted(self.marks.items())[-1]
        steps = max(1, end - start)
        result.update({k.replace("_bytes", "_per_step"): (b[k] - a[k]) / steps for k in a})
        self.path.write_text(json.dumps(result))


def _ddp_rank(rank: int, world: int, port, cfg, threads: int, fp16: bool, out) -> None:
    """DDP over gloo of the config's model (resnet18 here), with or without DDP's fp16
    compression hook (gradients halved on the wire, summed, then cast back)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    from benchmarks.peers import _setup, init_gloo, train_and_report
    from psrpc.optim.dense import build_optimizer

    torch.set_num_threads(threads)
    init_gloo(rank, world, port)
    _, model, loss_fn, batches = _setup(cfg, world, rank)
    model = DDP(model)
    if fp16:
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    opt = build_optimizer(list(model.parameters()), cfg.optim)
    train_and_report(model, loss_fn, batches, [opt], cfg, rank, world, out)


def main(argv: list[str]) -> None:
    import os

    from benchmarks import embeddings, peers
    from benchmarks.common import psrpc_config

    system, out_path, threads, *overrides = argv
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cfg = psrpc_config(overrides)
    out = _Out(out_path)
    peers.AT_CLOCK.append(out.mark)
    threads = int(threads)
    if system == "ddp_sparse":
        embeddings._local_rank(rank, world, None, cfg, True, threads, out)
    elif system == "torchrec":
        embeddings._torchrec_rank(rank, world, None, cfg, threads, out)
    elif system in ("ddp", "ddp_fp16"):
        _ddp_rank(rank, world, None, cfg, threads, system == "ddp_fp16", out)
    else:
        sys.exit(f"link_peer: unknown system {system!r}: ddp_sparse, torchrec, ddp, ddp_fp16")


class LinkBytes(Hook):
    """A psrpc hook on the chief: the bytes its host's eth1 sent and received per step from
    step `from_step` to the last, into out_dir/link_bytes.json (the psrpc side of the same
    measurement)."""

    def __init__(self, from_step: int):
        self.from_step, self.start, self.stop, self.out_dir = from_step, None, None, None

    def begin(self, run) -> None:
        self.out_dir = run.out_dir

    def after_step(self, info) -> None:
        if self.start is None and info.step >= self.from_step:
            self.start = (info.step, iface_bytes())
        elif self.start is not None:  # (the window ends with the last step, as samples/s's)
            self.stop = (info.step, iface_bytes())

    def end(self, summary: dict) -> None:
        if self.start is None or self.stop is None:
            return
        (step0, a), (step1, b) = self.start, self.stop
        steps = max(1, step1 - step0)
        (Path(self.out_dir) / "link_bytes.json").write_text(json.dumps(
            {k.replace("_bytes", "_per_step"): (b[k] - a[k]) / steps for k in a}))


if __name__ == "__main__":
    main(sys.argv[1:])
