"""Checkpoints: the write side (writer.py: shard files, buffers, the manifest that commits a
step, pruning), the restore side (restore.py: the newest step that checks out, re-split for any
number of PS) and what a valid manifest and shard file hold (manifest.py)."""

from psrpc.checkpoint.manifest import MANIFEST, file_digest, step_dir, step_problem, steps_on_disk
from psrpc.checkpoint.restore import Restored, find_latest, reshard, shard_stats
from psrpc.checkpoint.writer import (StepCommitted, is_committed, prune, save_buffers, save_shard,
                                     write_atomic, write_manifest)

__all__ = ["MANIFEST", "Restored", "StepCommitted", "file_digest", "find_latest", "is_committed",
           "prune", "reshard", "save_buffers", "save_shard", "shard_stats", "step_dir",
           "step_problem", "steps_on_disk", "write_atomic", "write_manifest"]
