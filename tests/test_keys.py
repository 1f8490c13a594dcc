"""psrpc/keys.py: a retired key still works, with a line naming what replaced it; fault keys opt
in to their group; a key the schema lacks is refused with the nearest one that it has."""

import logging
import os
import re
from pathlib import Path

import pytest

from psrpc import keys, knobs
from psrpc.errors import ConfigError
from tests.conftest import compose, run_cluster

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("override, env, value", [
    ("cluster.rpc_timeout_s=75", "PSRPC_RPC_TIMEOUT_S", "75"),
    ("cluster.rpc_threads=4", "PSRPC_RPC_THREADS", "4"),
    ("cluster.ps_threads=2", "PSRPC_PS_THREADS", "2"),
    ("cluster.transports=[uv,shm]", "PSRPC_TP_TRANSPORTS", "uv,shm"),
    ("cluster.channels=[basic]", "PSRPC_TP_CHANNELS", "basic"),
])
def test_a_retired_key_is_accepted_with_a_line_and_its_value_kept(caplog, override, env, value):
    with caplog.at_level(logging.WARNING, logger="psrpc"):
        cfg = compose([override])
    key = override.split("=")[0]
    said = [r.getMessage() for r in caplog.records if key in r.getMessage()]
    assert len(said) == 1 and "is retired" in said[0] and env in said[0], said
    assert os.environ[env] == value
    assert not hasattr(cfg.cluster, key.split(".")[1])


def test_a_renamed_key_keeps_working_under_its_old_name_with_a_line(caplog):
    with caplog.at_level(logging.WARNING, logger="psrpc"):
        cfg = compose(["train.warmup_steps=7"])
    assert cfg.train.untimed_steps == 7
    assert any("train.warmup_steps is now train.untimed_steps" in r.getMessage()
               for r in caplog.records)


def test_a_retired_key_set_to_null_keeps_the_default(caplog):
    with caplog.at_level(logging.WARNING, logger="psrpc"):
        compose(["cluster.rpc_timeout_s=null"])
    assert "PSRPC_RPC_TIMEOUT_S" not in os.environ
    assert any("cluster.rpc_timeout_s is retired" in r.getMessage() for r in caplog.records)


def test_keys_with_one_meaning_in_async_are_dropped_there_and_refused_otherwise(caplog):
    with caplog.at_level(logging.WARNING, logger="psrpc"):
        cfg = compose(["update=async", "update.dense=ps", "update.host_push=off"])
    assert (cfg.update.dense, cfg.update.host_push) == ("ps", "off")
    assert sum("is retired" in r.getMessage() for r in caplog.records) == 2
    with pytest.raises(ConfigError, match="update.host_push='on': needs update=sync"):
        compose(["update=async", "update.host_push=on"])
    # sync keeps both keys
    assert compose(["update.dense=allreduce"]).update.dense == "allreduce"


@pytest.mark.parametrize("typo, meant", [
    ("cluster.num_wrkers=3", "cluster.num_workers"), ("trian.steps=3", "train.steps"),
    ("sparse.cache_row=8", "sparse.cache_rows"), ("optim.moment=0.5", "optim.momentum"),
    ("update.max_stalenes=2", "update.max_staleness"), ("fault.crash_rol=ps", "fault.crash_role"),
])
def test_a_key_the_schema_lacks_names_the_nearest_it_has(typo, meant):
    with pytest.raises(ConfigError, match=f"did you mean {re.escape(meant)}\\?"):
        compose([typo])


def test_factory_arguments_and_hydra_keys_are_not_second_guessed():
    keys.translate(["model.hidden=64", "data.root=x", "hydra.run.dir=y", "+model.extra=1"])


def test_fault_keys_opt_in_to_their_group(caplog):
    assert compose([]).fault.crash_role is None  # no fault group: nothing injected
    with caplog.at_level(logging.WARNING, logger="psrpc"):
        cfg = compose(["fault.crash_role=ps", "fault.crash_at_step=3"])
    assert cfg.fault.crash_role == "ps" and cfg.fault.crash_at_step == 3
    assert any("fault=inject added" in r.getMessage() for r in caplog.records)
    assert compose(["fault=inject"]).fault.crash_role is None


def test_every_retired_key_is_in_the_changelog():
    changelog = (ROOT / "CHANGELOG.md").read_text()
    for key in [*keys.RETIRED, *keys.ASYNC_RETIRED, *keys.RENAMED, *keys.RENAMED.values()]:
        assert f"`{key}`" in changelog, key
    for knob in knobs.ALL:
        assert knob.env in changelog and knob.env in (ROOT / "docs" / "configuration.md").read_text()


def test_the_ranks_get_the_launchers_knobs(tmp_path, monkeypatch):
    """A knob set in the launcher after its forkserver started (a retired key composed in a
    long-lived process) still reaches every rank: each logs it and runs with it."""
    monkeypatch.setenv("PSRPC_PS_THREADS", "1")  # the forkserver may have any value; the
    run_cluster(tmp_path / "warm", ["train.steps=2"])  # run's own wins
    run_cluster(tmp_path / "out", ["train.steps=2", "cluster.rpc_threads=3"])
    for rank in ("ps0", "worker0", "worker1"):
        log = (tmp_path / "out" / "logs" / f"{rank}.log").read_text()
        assert "PSRPC_RPC_THREADS=3" in log and "PSRPC_PS_THREADS=1" in log, log


def test_a_retired_key_in_a_sweep_is_refused_naming_its_variable():
    with pytest.raises(ConfigError, match="cluster.rpc_threads is retired.*PSRPC_RPC_THREADS.*"
                                          "a sweep cannot set an environment variable"):
        keys.translate(["cluster.rpc_threads=2,4"])
