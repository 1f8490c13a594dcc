"""Where a run listens. RPC unpickles what peers send, so whoever reaches a listener of a run can
run code in every rank: a local run must listen on loopback only, and a named interface must
exist (docs/security.md)."""

import ipaddress
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

import psutil
import pytest

from psrpc.cluster import comm, netif
from psrpc.cluster.topology import Topology
from psrpc.errors import ConfigError
from psrpc.launch import free_port, local_interface
from tests.conftest import CPU, compose

pytestmark = pytest.mark.timeout(120)
TORCHRUN_ENV = {"RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}


def _listening(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every listening TCP socket of process `pid`."""
    try:
        conns = psutil.Process(pid).net_connections(kind="inet")
    except psutil.Error:  # gone meanwhile
        return []
    return [(c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN]


def _not_loopback(listeners) -> list:
    return [(ip, port) for ip, port in listeners if not ipaddress.ip_address(ip).is_loopback]


def _other_interface():
    """A non-loopback interface with an address, if this machine has one."""
    return next((n for n, ips in sorted(netif.interfaces().items())
                 if ips and not netif.is_loopback_interface(n)), None)


def test_a_local_run_listens_on_loopback_only(tmp_path):
    """Every process of `python -m psrpc` (launcher, forkserver, ranks) while it trains: the
    rendezvous store and TensorPipe on loopback, even when the environment names another
    interface (TP_SOCKET_IFNAME is for torchrun runs)."""
    other = _other_interface()
    env = dict(os.environ)
    if other:
        env.update(TP_SOCKET_IFNAME=other, GLOO_SOCKET_IFNAME=other)
    log = tmp_path / "stderr.log"
    with open(log, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "psrpc", "train.steps=1000000", "train.log_every=10",
             "data.size=2048", "data.test_size=0", f"out_dir={tmp_path / 'out'}", CPU],
            cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.monotonic() + 90
        while "step    10/" not in log.read_text():  # training: every listener is open
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        launcher = psutil.Process(proc.pid)
        (server,) = [p for p in launcher.children() if "forkserver" in " ".join(p.cmdline())]
        ranks = server.children()
        assert len(ranks) == 3  # ps0, worker0, worker1
        listeners = {p.pid: _listening(p.pid) for p in [launcher, server, *ranks]}
        assert all(listeners[r.pid] for r in ranks), listeners  # TensorPipe in every rank
        exposed = {pid: _not_loopback(ls) for pid, ls in listeners.items() if _not_loopback(ls)}
        assert not exposed, f"listening beyond loopback (pid: [(address, port)]): {exposed}"
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def test_rendezvous_store_listens_on_the_master_address_only():
    """The store rank 0 hosts binds MASTER_ADDR's address (torch's tcp:// store binds every
    interface)."""
    port = free_port()
    url = f"psrpc://127.0.0.1:{port}?timeout_s=10&attempt=0&agent_store=0&rank=0&world_size=1"
    store, rank, world_size = next(comm._rendezvous(url))
    try:
        store.set("k", "v")
        assert store.get("k") == b"v"
        assert [ls for ls in _listening(os.getpid()) if ls[1] == port] == [
            ("127.0.0.1", port)]
    finally:
        del store


def test_unknown_interface_is_named_with_those_that_exist():
    lo = netif.loopback_interface()
    with pytest.raises(ConfigError, match=rf"cluster.interface='nosuch0': no such network "
                                          rf"interface here; this machine has .*\b{lo}\b"):
        compose(["cluster.interface=nosuch0"])
    with pytest.raises(ConfigError, match=r"TP_SOCKET_IFNAME='nosuch0': no such network"):
        Topology.from_env(1, 2, env={**TORCHRUN_ENV, "TP_SOCKET_IFNAME": "nosuch0"})
    with pytest.raises(ConfigError, match=r"GLOO_SOCKET_IFNAME='nosuch1': no such network"):
        Topology.from_env(1, 2, env={**TORCHRUN_ENV, "GLOO_SOCKET_IFNAME": f"{lo},nosuch1"})


def test_torchrun_interface_from_config_or_environment():
    lo = netif.loopback_interface()
    assert Topology.from_env(1, 2, env=TORCHRUN_ENV).interface is None  # the host name's
    assert Topology.from_env(1, 2, interface=lo, env=TORCHRUN_ENV).interface == lo
    assert Topology.from_env(1, 2, env={**TORCHRUN_ENV, "TP_SOCKET_IFNAME": lo}).interface == lo
    assert Topology.from_env(1, 2, env={**TORCHRUN_ENV, "GLOO_SOCKET_IFNAME": lo}).interface == lo
    other = _other_interface()
    if other:
        with pytest.raises(ConfigError, match=rf"cluster.interface='{lo}', TP_SOCKET_IFNAME="
                                              rf"'{other}': name one interface"):
            Topology.from_env(1, 2, interface=lo, env={**TORCHRUN_ENV, "TP_SOCKET_IFNAME": other})


def test_local_launcher_listens_on_loopback_and_refuses_another_interface():
    lo = netif.loopback_interface()
    assert local_interface(compose([])) == lo
    assert local_interface(compose([f"cluster.interface={lo}"])) == lo
    other = _other_interface()
    if other is None:
        pytest.skip("no interface besides loopback here")
    with pytest.raises(ConfigError, match=rf"cluster.interface='{other}': the local launcher "
                                          rf"runs every rank on this machine and listens on "
                                          rf"loopback \({lo}\) only"):
        local_interface(compose([f"cluster.interface={other}"]))
