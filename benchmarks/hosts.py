"""Emulated hosts on one Linux machine, for the tests and benchmarks that need several machines.

Each host is a set of namespaces of its own, as a real machine would have:
- network: one interface, `eth1`, with an address from 198.18.0.0/24 (the range set aside for
  benchmarking networks, RFC 2544), plugged into a bridge that lives in a namespace of its own;
  its loopback; no route anywhere else;
- PID: its processes see only each other (TensorPipe's cross-process memory copy and psrpc's
  host id cannot reach across hosts);
- UTS: its own host name (`h0`, `h1`, ..., or the first label of the DNS name it is given);
- mount: its own `/dev/shm` (a tmpfs), an `/etc/hosts` naming every host, and optionally a
  folder of its own mounted at one path every host sees (`disk`: files on each host's own disk).

Per link (a host's cable to the bridge): a bandwidth in both directions (tc tbf on both ends).
Faults: `partition` a host (its cable is taken off the bridge: both ends stay up, packets go
nowhere, as when a switch port is cut) and `heal` it; `set_rate` mid-run (a slow link);
`power_off` (every process of the host killed at once) and `power_on` (a fresh PID, UTS and
mount namespace on the same network).

`Hosts` is a context manager: on exit, on an exception and on Ctrl-C every process, namespace
and interface it made is removed (`leftovers` lists what is left of any emulation on this
machine; `sweep` removes it). Needs root, ip(8), tc(8), unshare(1) and nsenter(1): `missing()`
says what is not there.

    with Hosts(2, rate_mbit=1000) as hosts:
        p = hosts.popen(0, ["python", "-m", "psrpc", ...])
        hosts.partition(1); time.sleep(8); hosts.heal(1)
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

import psutil

PREFIX = "psh"  # every namespace and interface name starts with it
NET = "198.18.0"  # 198.18.0.0/24
FIRST = 11  # host k is 198.18.0.(11 + k)
TOOLS = ("ip", "tc", "unshare", "nsenter")


def missing() -> Optional[str]:
    """Why hosts cannot be emulated here (not root, a tool missing), or None."""
    if os.geteuid() != 0:
        return "emulated hosts need root (network and PID namespaces)"
    absent = [t for t in TOOLS if shutil.which(t) is None]
    return f"emulated hosts need {', '.join(absent)}" if absent else None


def _run(*cmd: str, check: bool = True, timeout: float = 30) -> str:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {out.stderr.strip() or out.returncode}")
    return out.stdout


def leftovers() -> list[str]:
    """Namespaces and interfaces of any emulation on this machine that are still there."""
    spaces = [line.split()[0] for line in _run("ip", "netns", "list").splitlines()
              if line.startswith(PREFIX)]
    links = [line.split(":")[1].strip().split("@")[0] for line in
             _run("ip", "-o", "link", "show").splitlines()
             if line.split(":")[1].strip().startswith(PREFIX)]
    return [f"netns {s}" for s in spaces] + [f"link {n}" for n in links]


def sweep(only: Optional[list[str]] = None) -> None:
    """Remove what `leftovers` lists (after an emulation that could not clean up: kill -9), or
    the entries of it in `only`."""
    left = [s for s in leftovers() if only is None or s in only]
    for space in [s.split()[1] for s in left if s.startswith("netns ")]:
        for pid in _run("ip", "netns", "pids", space, check=False).split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        _run("ip", "netns", "del", space, check=False)
    for link in [s.split()[1] for s in leftovers() if s.startswith("link ") and s in left]:
        _run("ip", "link", "del", link, check=False)


class Hosts:
    """`n` emulated hosts joined by a bridge; `rate_mbit`: each link's bandwidth (None: as fast
    as the machine moves packets); `disk`: a path at which each host sees a folder of its own;
    `own_name_loopback`: each host's /etc/hosts gives its own name 127.0.1.1, as stock Debian
    and Ubuntu do (the other hosts' names keep their addresses); `names`: each host's DNS name
    (`h0`, `h1`, ... by default), as a cluster's DNS would give it, e.g. a pod's
    `psrpc-ranks-0-1.psrpc`: the host name is its first label, every host's /etc/hosts names
    every host by its DNS name and itself by its host name too (as the kubelet writes a pod's)."""

    def __init__(self, n: int, rate_mbit: Optional[float] = None, disk: Optional[str] = None,
                 own_name_loopback: bool = False, names: Optional[list[str]] = None):
        if (why := missing()) is not None:
            raise RuntimeError(why)
        if names is not None and len(names) != n:
            raise ValueError(f"{len(names)} names for {n} hosts")
        self.n, self.rate_mbit, self.disk_path = n, rate_mbit, disk
        self.dns_names = list(names) if names is not None else [f"h{k}" for k in range(n)]
        self.own_name_loopback = own_name_loopback
        self.id = secrets.token_hex(2)
        self.root = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{self.id}-"))
        self.bridge_ns = f"{PREFIX}{self.id}-br"
        self._holders: dict[int, subprocess.Popen] = {}
        self._rates: dict[int, Optional[float]] = {}

    # -- names ------------------------------------------------------------------------------
    def ns(self, k: int) -> str:
        return f"{PREFIX}{self.id}-h{k}"

    def _cable(self, k: int) -> str:  # the bridge's end of host k's cable (<= 15 characters)
        return f"{PREFIX}{self.id}b{k}"

    def addr(self, k: int) -> str:
        return f"{NET}.{FIRST + k}"

    def name(self, k: int) -> str:
        """Host k's host name: the first label of its DNS name."""
        return self.dns_names[k].split(".")[0]

    def dns_name(self, k: int) -> str:
        return self.dns_names[k]

    def disk(self, k: int) -> Path:
        """Host k's own folder (what it sees at `disk`)."""
        return self.root / f"disk{k}"

    # -- life -------------------------------------------------------------------------------
    def __enter__(self) -> "Hosts":
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _hosts_file(self, k: int) -> Path:
        """Host k's /etc/hosts: every host's DNS name and address, and its own host name (its
        own at 127.0.1.1 with `own_name_loopback`)."""
        lines = ["127.0.0.1 localhost"]
        for j in range(self.n):
            own_short = j == k and self.name(j) != self.dns_name(j)
            names = [self.dns_name(j)] + ([self.name(j)] if own_short else [])
            addr = "127.0.1.1" if j == k and self.own_name_loopback else self.addr(j)
            lines.append(f"{addr} {' '.join(names)}")
        path = self.root / f"hosts{k}"
        path.write_text("\n".join(lines) + "\n")
        return path

    def _build(self) -> None:
        _run("ip", "netns", "add", self.bridge_ns)
        inbr = ("ip", "netns", "exec", self.bridge_ns)
        _run(*inbr, "ip", "link", "add", "br0", "type", "bridge")
        _run(*inbr, "ip", "link", "set", "br0", "up")
        for k in range(self.n):
            host_end = f"{PREFIX}{self.id}h{k}"
            _run("ip", "netns", "add", self.ns(k))
            _run("ip", "link", "add", self._cable(k), "type", "veth", "peer", "name", host_end)
            _run("ip", "link", "set", self._cable(k), "netns", self.bridge_ns)
            _run("ip", "link", "set", host_end, "netns", self.ns(k))
            _run(*inbr, "ip", "link", "set", self._cable(k), "master", "br0", "up")
            inh = ("ip", "netns", "exec", self.ns(k))
            _run(*inh, "ip", "link", "set", host_end, "name", "eth1")
            _run(*inh, "ip", "addr", "add", f"{self.addr(k)}/24", "dev", "eth1")
            _run(*inh, "ip", "link", "set", "eth1", "up")
            _run(*inh, "ip", "link", "set", "lo", "up")
            self.disk(k).mkdir()
            self.set_rate(k, self.rate_mbit)
            self.power_on(k)

    def power_on(self, k: int) -> None:
        """Start host k: fresh PID, UTS and mount namespaces (host name, /etc/hosts, /dev/shm,
        its disk) on its network; the holder is the host's init (PID 1)."""
        mounts = [f"hostname {self.name(k)}", "mount --make-rprivate /",
                  "mount -t tmpfs -o mode=1777 tmpfs /dev/shm",
                  f"mount --bind {self._hosts_file(k)} /etc/hosts"]
        if self.disk_path:
            Path(self.disk_path).mkdir(parents=True, exist_ok=True)
            mounts.append(f"mount --bind {self.disk(k)} {self.disk_path}")
        script = " && ".join(mounts) + " && echo up && exec sleep infinity"
        holder = subprocess.Popen(
            ["ip", "netns", "exec", self.ns(k), "unshare", "--uts", "--mount", "--pid", "--fork",
             "--mount-proc", "sh", "-c", script], stdout=subprocess.PIPE, text=True,
            stderr=subprocess.DEVNULL, start_new_session=True)
        if holder.stdout.readline().strip() != "up":
            holder.kill()
            raise RuntimeError(f"host {k} did not start: {holder.wait(timeout=10)}")
        self._holders[k] = holder

    def _init_pid(self, k: int) -> int:
        """Host k's PID 1 as this machine numbers it (the holder's `sleep`)."""
        (child,) = psutil.Process(self._holders[k].pid).children()
        return child.pid

    def power_off(self, k: int) -> None:
        """Every process of host k killed at once (its PID 1 dies: the kernel kills the rest)."""
        if k not in self._holders:
            return
        try:
            os.kill(self._init_pid(k), signal.SIGKILL)
        except (ValueError, psutil.Error, ProcessLookupError):
            pass
        holder = self._holders.pop(k)
        holder.kill()
        holder.wait(timeout=10)

    def close(self) -> None:
        """Remove every process, namespace and interface of these hosts, and their files."""
        for k in list(self._holders):
            try:
                self.power_off(k)
            except Exception:  # go on: the namespaces below go anyway
                self._holders.pop(k, None)
        for k in range(self.n):
            _run("ip", "netns", "del", self.ns(k), check=False)  # its end of the cable with it
        _run("ip", "netns", "del", self.bridge_ns, check=False)
        if self.disk_path:
            try:
                Path(self.disk_path).rmdir()
            except OSError:
                pass
        shutil.rmtree(self.root, ignore_errors=True)

    # -- running things ---------------------------------------------------------------------
    def command(self, k: int, cmd: list[str], cwd=None) -> list[str]:
        """`cmd` as run on host k (its network, PID, UTS and mount namespaces), in `cwd` (this
        process's working directory by default; the folders are the machine's, but `disk`)."""
        return ["nsenter", f"--target={self._init_pid(k)}", "--net", "--pid", "--uts", "--mount",
                f"--wd={cwd or os.getcwd()}", "--", *cmd]

    def popen(self, k: int, cmd: list[str], cwd=None, **kw) -> subprocess.Popen:
        """Start `cmd` on host k (subprocess.Popen's keywords)."""
        return subprocess.Popen(self.command(k, cmd, cwd), **kw)

    def run(self, k: int, cmd: list[str], timeout: float = 60, cwd=None,
            **kw) -> subprocess.CompletedProcess:
        """Run `cmd` on host k to its end."""
        return subprocess.run(self.command(k, cmd, cwd), timeout=timeout, capture_output=True,
                              text=True, **kw)

    # -- the network ------------------------------------------------------------------------
    def set_rate(self, k: int, mbit: Optional[float]) -> None:
        """Host k's link: `mbit` Mbit/s each way (None: no limit)."""
        for ns, dev in ((self.ns(k), "eth1"), (self.bridge_ns, self._cable(k))):
            if mbit is None:
                _run("ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root",
                     check=False)
                continue
            burst = max(int(mbit * 1e6 / 8 / 250), 16 * 1514)  # 4 ms of traffic
            _run("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf",
                 "rate", f"{mbit}mbit", "burst", str(burst), "latency", "50ms")
        self._rates[k] = mbit

    def partition(self, k: int) -> None:
        """Cut host k off: its cable leaves the bridge (both ends stay up; packets are lost)."""
        _run("ip", "netns", "exec", self.bridge_ns, "ip", "link", "set", self._cable(k),
             "nomaster")

    def heal(self, k: int) -> None:
        _run("ip", "netns", "exec", self.bridge_ns, "ip", "link", "set", self._cable(k),
             "master", "br0")

    def counters(self, k: int) -> dict[str, int]:
        """Bytes host k's interface sent and received so far."""
        stats = {}
        for what in ("tx_bytes", "rx_bytes"):
            stats[what] = int(_run("ip", "netns", "exec", self.ns(k), "cat",
                                   f"/sys/class/net/eth1/statistics/{what}").strip())
        return stats
