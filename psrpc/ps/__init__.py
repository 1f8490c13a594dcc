"""Runs in a parameter-server process: the shards (dense and tables), their update rules (sync
barrier, async apply, bounded staleness), optimizers, checkpoints, and what a PS serves over RPC.
Never imports the worker side: what both agree on is in psrpc/cluster/wire.py."""
