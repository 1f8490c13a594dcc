"""Entry point: `python -m psrpc [overrides]`, `torchrun ... -m psrpc`, `srun python -m psrpc`,
and `python -m psrpc -m` (a sweep, through the local launcher or Hydra's submitit launcher).

Started by nobody (no RANK, no SLURM task of many) this process is the local launcher and starts
the whole cluster; under torchrun, srun or a submitit job each process runs its own rank
(psrpc/cluster/topology.py reads which). Either way: parse, validate, build, run.
"""

from __future__ import annotations

import logging
import os
import sys
from datetime import datetime
from pathlib import Path

from psrpc.environment import apply_env_defaults

apply_env_defaults()  # before torch loads: this process is psrpc's own


import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from torch.distributed.elastic.multiprocessing.errors import record

from psrpc import api, helptext, keys
from psrpc.cluster import membership, partitions, slurm, store
from psrpc.cluster.launchers import launched, launched_rank, shared_run_id
from psrpc.cluster.topology import Topology
from psrpc.config import register_configs, to_config
from psrpc.errors import PsrpcError, exit_code, first_line, network_failure
from psrpc.process import setup_logging
from psrpc.validate import check_run, check_values, resolve_paths


def _run_dir(base: str) -> str:
    """hydra.run.dir: the ranks of one torchrun or srun run resolve ${now} apart, so they share
    the launcher's run id instead (outputs/torchrun/<run id>, outputs/slurm/<job>.<step>)."""
    run_id = shared_run_id()
    if run_id:
        return f"{base}/{run_id}"
    port = os.environ.get("MASTER_PORT") if "RANK" in os.environ else None
    stamp = datetime.now().strftime("%Y-%m-%d/%H-%M" if port else "%Y-%m-%d/%H-%M-%S")
    return f"{base}/{stamp}" + (f"-port{port}" if port else "")


def _hydra_subdir():
    """Only one rank writes .hydra/ into the shared run directory."""
    return ".hydra" if launched_rank() in (None, 0) else None


OmegaConf.register_new_resolver("psrpc_run_dir", _run_dir, replace=True)
OmegaConf.register_new_resolver("psrpc_hydra_subdir", _hydra_subdir, replace=True)
OmegaConf.register_new_resolver("psrpc_tasks_per_node", slurm.launcher_tasks_per_node,
                                replace=True)
register_configs()


def _leave(code: int = 0) -> None:
    """A torchrun or srun rank whose work is done leaves as the local launcher's ranks do, with
    os._exit: a rank that changed membership epochs (or lost its connections) keeps RPC agents
    of old groups, and a normal exit runs torch's C++ destructors on their threads, still
    joinable (std::terminate: SIGABRT, and a failed torchrun agent); a failed one the same,
    with its code."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
@record  # under torchrun: the error reaches torchrun's summary instead of Hydra's sys.exit(1)
def main(dcfg: DictConfig) -> None:
    try:
        cfg = to_config(dcfg)
        resolve_paths(cfg)
        check_values(cfg)
        check_run(cfg)
        out_dir = Path(cfg.out_dir or HydraConfig.get().runtime.output_dir)
        topo = Topology.from_config(cfg)
        if topo.rank is None:
            setup_logging("launcher", None)
        elif HydraConfig.get().mode == RunMode.MULTIRUN and not topo.submitit:
            # A submitit task runs its rank of one job of the sweep; torchrun's and srun's
            # ranks would each run the whole sweep
            raise PsrpcError("multirun (-m) under torchrun or srun would run the whole sweep "
                             "on every rank: run sweeps with the local launcher (python -m "
                             "psrpc -m ...) or Hydra's submitit launcher (README: SLURM)")
        api.run(cfg, out_dir, topo=topo)
        if topo.rank is not None and not topo.submitit:
            partitions.depart()  # (srun's task 0 keeps the store for ranks still cut off)
            _leave()
    except membership.TrainingOver as e:  # a rank cut off until the run ended: nothing failed
        logging.getLogger("psrpc").warning("%s; leaving", e)
        partitions.depart()
        _leave()
    except Exception as e:
        if not (isinstance(e, PsrpcError) or network_failure(e)):
            _abandon()
            raise  # a bug: its traceback
        # one write, newline included: ranks of a host share one stderr, and a signal between
        # print's two writes would leave the line unended
        code = exit_code(e)  # 2: fix the input; 138: start this rank again, it rejoins
        sys.stderr.write(f"psrpc: error: {e if isinstance(e, PsrpcError) else first_line(e)}\n")
        sys.stderr.flush()
        if _own_rank():
            partitions.depart(wait_for_others=False, failed=str(e))  # (none need wait for it)
            store.linger()
            _leave(code)
        sys.exit(code)
    except BaseException:  # an interrupt: nobody need wait for this rank either
        _abandon()
        raise


def _abandon() -> None:
    if _own_rank():
        partitions.depart(wait_for_others=False)


def _own_rank() -> bool:
    """A torchrun or srun rank: it leaves with os._exit, whether its work is done or failed."""
    try:
        started = launched(os.environ)
    except PsrpcError:
        return False
    return started is not None and not started.submitit


def cli() -> None:
    """`python -m psrpc` and the `psrpc` command. --help (-h) is psrpc's own: every key of the
    config the other arguments compose, its value and its meaning (psrpc/helptext.py);
    --hydra-help is Hydra's. Everything else goes to Hydra (`main`)."""
    args = sys.argv[1:]
    try:
        args = _translated(args)
        if not helptext.asked(args):
            sys.argv[1:] = args
            main()
            return
        sys.stdout.write(helptext.text(helptext.overrides_of(args)))
    except (PsrpcError, HydraException, OmegaConfBaseException) as e:  # a bad override: one line, as a run says it
        sys.stderr.write(f"psrpc: error: {first_line(e)}\n")
        sys.exit(2)


_FLAGS_WITH_VALUE = {"--config-dir", "-cd", "--config-path", "-cp", "--config-name", "-cn",
                     "--experimental-rerun", "--info", "-i"}


def _translated(args: list[str]) -> list[str]:
    """The overrides among Hydra's arguments through psrpc/keys.py (retired keys, the opt-in
    fault group, "did you mean"); its flags, and their values, as they were."""
    flags, overrides, after_flag = [], [], False
    for arg in args:
        (flags if after_flag or arg.startswith("-") else overrides).append(arg)
        after_flag = arg in _FLAGS_WITH_VALUE
    return flags + keys.translate(overrides)


if __name__ == "__main__":
    cli()
