"""psrpc from Python: the same processes and outputs as the command line.

    import psrpc

    summary = psrpc.train(["cluster.num_workers=2", "train.steps=200"],
                          model={"_target_": "my.pkg.make_net", "hidden": 128},
                          data={"_target_": "my.pkg.make_datasets", "path": "corpus.txt"},
                          loss="torch.nn.MSELoss", metric="my.pkg.R2")
    print(summary["test_r2"])

Without RANK in the environment it runs the whole local cluster (as `python -m psrpc`); under
torchrun (`torchrun --nproc-per-node=3 my_script.py`) each process joins as its rank, and the
chief's call returns the summary (the others return None). A script that calls `train` needs
`if __name__ == "__main__":` around it, as any program that starts processes does.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import sys
from datetime import datetime
from pathlib import Path
from typing import Optional, Sequence, Union

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser

from psrpc import keys
from psrpc.cluster import netif
from psrpc.cluster.topology import Topology
from psrpc.config import Config, register_configs, to_config
from psrpc.errors import PsrpcError
from psrpc.launch import launch
from psrpc.process import run_rank
from psrpc.validate import check_run, check_values, resolve_paths

CONF_DIR = Path(__file__).resolve().parent / "conf"  # inside the package: a wheel holds it
Factory = Union[str, dict, None]
log = logging.getLogger("psrpc")


def compose(overrides: Sequence[str] = (), config_dir: Optional[str] = None,
            cwd: Optional[str] = None, **factories: Factory) -> Config:
    """The typed, checked Config that `python -m psrpc <overrides>` would run. `config_dir`
    adds a folder of your own config groups (as the CLI's -cd); `model=`, `data=`, `loss=`,
    `metric=` replace those nodes: an import path, or a dict with `_target_` and arguments."""
    register_configs()
    overrides = keys.translate(overrides)
    if config_dir:
        path = Path(cwd or os.getcwd()) / config_dir
        overrides.append(f"hydra.searchpath=[file://{path.resolve()}]")
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = to_config(hydra_compose("config", overrides=overrides))
    given = {k: v for k, v in factories.items() if v is not None}
    for key, spec in given.items():
        setattr(cfg, key, {"_target_": spec} if isinstance(spec, str) else dict(spec))
    _apply_to_factories(cfg, overrides, given)
    resolve_paths(cfg, cwd)
    check_values(cfg)
    return cfg


def _apply_to_factories(cfg: Config, overrides: list[str], given: dict) -> None:
    """`data.size=1024` beside `data={...}`: the override applies to the node given from Python
    (which replaced the config's whole node, and with it what Hydra had applied there)."""
    for o in OverridesParser.create().parse_overrides(
            [o for o in overrides if o.lstrip("+~").split(".", 1)[0] in given]):
        key, _, path = o.key_or_group.partition(".")
        node = getattr(cfg, key)
        *parents, leaf = path.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        if o.is_delete():
            node.pop(leaf, None)
        else:
            node[leaf] = o.value()


def train(overrides: Sequence[str] = (), *, model: Factory = None, data: Factory = None,
          loss: Factory = None, metric: Factory = None, config_dir: Optional[str] = None,
          timeout_s: Optional[float] = None) -> Optional[dict]:
    """Train; returns summary.json's content (None on a non-chief rank under torchrun). Bad
    input raises psrpc.errors.PsrpcError (one clear message) before any process starts; a
    failed run raises psrpc.launch.ClusterFailed naming the rank."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        # A rank re-imports the main module (as multiprocessing does), and this script calls
        # train at its top level: it would start a cluster from inside the cluster.
        print("psrpc: error: psrpc.train() ran while a process psrpc started was importing your "
              "script (every rank re-imports the main module, as multiprocessing does): call it "
              "under `if __name__ == \"__main__\":`", file=sys.stderr, flush=True)
        raise SystemExit(2)
    cfg = compose(overrides, config_dir, model=model, data=data, loss=loss, metric=metric)
    check_run(cfg)
    out_dir = Path(cfg.out_dir or Path("outputs") / datetime.now().strftime("%Y-%m-%d/%H-%M-%S"))
    return run(cfg, out_dir, timeout_s)


def run(cfg: Config, out_dir: Path, timeout_s: Optional[float] = None,
        topo: Optional[Topology] = None) -> Optional[dict]:
    """The local cluster (no launcher started this process), or this process's rank under
    torchrun, srun or submitit; the chief's summary, None on the other ranks."""
    topo = topo or Topology.from_config(cfg)
    if topo.rank is None:
        lost = launch(cfg, out_dir, timeout_s=timeout_s)
        log.info("outputs in %s%s", out_dir, f" ({', '.join(lost)} lost)" if lost else "")
    else:  # (a listen address or rendezvous host no other host can use: said now, not after
        # cluster.init_timeout_s on another host)
        netif.check_many_hosts(topo.interface, topo.master_addr, topo.nodes)
        run_rank(cfg, topo, out_dir)
        if not topo.is_chief:
            return None
    summary = json.loads((Path(out_dir) / "summary.json").read_text())
    if summary.get("final_checkpoint_error"):  # trained, outputs written, checkpoint lost
        raise PsrpcError(summary["final_checkpoint_error"])
    return summary
