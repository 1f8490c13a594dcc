"""SLURM's compressed lists, read without SLURM: which node runs task 0, how many tasks a node
runs, and the rendezvous port a job's tasks agree on (psrpc.cluster.topology reads the variables); and
the tasks per node that psrpc's submitit launcher configs ask for.
"""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
import sys

# A port every task of a job computes alike from the job id, unless MASTER_PORT names one:
# 15000-24999, below Linux's ephemeral range (32768-60999), so that no outgoing connection
# holds it when task 0 comes to listen.
PORT_BASE = 15000
PORT_SPAN = 10000
SCONTROL_TIMEOUT_S = 30.0


def port_for_job(job_id: int) -> int:
    return PORT_BASE + job_id % PORT_SPAN


@functools.lru_cache(maxsize=8)
def first_host(nodelist: str) -> str:
    """The first host of a node list: `scontrol show hostnames` expands it where SLURM is
    installed (it reads every form SLURM writes), else `expand_nodelist`."""
    scontrol = shutil.which("scontrol") if "[" in nodelist else None
    if scontrol:
        try:
            hosts = subprocess.run([scontrol, "show", "hostnames", nodelist],
                                   capture_output=True, text=True, check=True,
                                   timeout=SCONTROL_TIMEOUT_S).stdout.split()
            if hosts:
                return hosts[0]
        except (OSError, subprocess.SubprocessError):
            pass  # the parser reads the usual forms
    return expand_nodelist(nodelist)[0]


def expand_nodelist(nodelist: str) -> list[str]:
    """`node[01-03,07],gpu5` -> node01 node02 node03 node07 gpu5. Ranges keep their zero
    padding; several bracket groups in one name (`r[1-2]n[1-2]`) expand in order. ValueError
    for what it cannot read."""
    items = re.findall(r"(?:[^,\[\]]|\[[^\[\]]*\])+", nodelist)
    if not items or ",".join(items) != nodelist:
        raise ValueError(f"cannot read node list {nodelist!r}")
    hosts = []
    for item in items:
        parts = re.split(r"\[([^\]]*)\]", item)  # text, group, text, group, ..., text
        names = [""]
        for i, part in enumerate(parts):
            choices = _expand_group(part, nodelist) if i % 2 else [part]
            names = [n + c for n in names for c in choices]
        hosts += names
    return hosts


def _expand_group(group: str, nodelist: str) -> list[str]:
    """`01-03,07` -> 01 02 03 07."""
    out = []
    for r in group.split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", r)
        if m is None:
            raise ValueError(f"cannot read {r!r} in node list {nodelist!r}")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        out += [f"{i:0{len(lo)}d}" for i in range(int(lo), int(hi) + 1)]
    return out


def tasks_per_node(text: str) -> list[int]:
    """`2(x3),1` -> [2, 2, 2, 1]: tasks on each node of the step, in node order."""
    counts = []
    for entry in text.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", entry.strip())
        if m is None:
            raise ValueError("cannot read it (SLURM writes e.g. '2(x3),1')")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def launcher_tasks_per_node(num_ps: int, num_workers: int, nodes: int) -> int:
    """hydra.launcher.tasks_per_node in conf/hydra/launcher/psrpc_*.yaml (a resolver): one task
    per rank, the same number on every node (submitit asks SLURM for --ntasks-per-node)."""
    ranks, nodes = int(num_ps) + int(num_workers), int(nodes)
    if nodes < 1 or ranks % nodes:
        # Hydra resolves this while it builds the launcher, outside any job and before one is
        # submitted: an exception would reach the user as a wall of Hydra's frames
        print(f"psrpc: error: hydra.launcher.nodes={nodes}: cluster.num_ps + cluster.num_workers "
              f"= {ranks} ranks do not split evenly over {nodes} nodes (submitit starts as many "
              "tasks on every node)", file=sys.stderr)
        sys.exit(2)
    return ranks // nodes
