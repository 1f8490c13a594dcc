"""Folders every PS must share with the chief (runs over hosts that have their own disks).

Each PS writes its part of a checkpoint into `checkpoint.dir` (a restore reads every part) and,
for a model with embedding tables, its rows into `out_dir/tables/` (which `load_tables` reads
on the chief's host). On hosts with their own disks those files land where nobody reads them:
a restore would miss shards, `load_tables` the rows. So before anything is written or restored,
the chief writes a file with a random name into each such folder and asks every PS whether it
sees it there; if one does not, the run stops with one line naming the key and the PS.
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Optional

from psrpc.cluster import comm
from psrpc.cluster.topology import Topology
from psrpc.config import Config
from psrpc.errors import PsrpcError
from psrpc.ps import service


def check_shared(cfg: Config, topo: Topology, out_dir: Optional[Path], tables: bool) -> None:
    """Raise, naming the key, when a PS does not see a folder it writes into as the chief does."""
    folders = []
    if cfg.checkpoint.dir:
        folders.append(("checkpoint.dir", str(cfg.checkpoint.dir),
                        "each PS writes its shards there and a restore reads all of them"))
    if tables and out_dir is not None:
        folders.append(("out_dir", str(out_dir), "each PS writes its rows of the tables into "
                        "out_dir/tables/, which load_tables reads"))
    for key, folder, why in folders:
        Path(folder).mkdir(parents=True, exist_ok=True)
        nonce = secrets.token_hex(8)
        marker = Path(folder) / f".psrpc-shared-{nonce}"
        marker.write_text(nonce)
        try:
            seen = comm.wait_all([comm.call(ps, service.sees, (folder, marker.name, nonce))
                                  for ps in topo.ps_names])
        finally:
            marker.unlink(missing_ok=True)
        blind = [ps for ps, ok in zip(topo.ps_names, seen) if not ok]
        if blind:
            raise PsrpcError(
                f"{key}={folder} is not the same folder on {', '.join(blind)} as on the chief "
                f"(another host's own disk?): {why}. Give {key} a folder every host shares "
                "(NFS, a cluster file system)")
