"""Runs in a worker process: the plan it receives from the chief, its clients of the dense and
table shards, the replica loops (data parallel, pipeline stages), flat buffers, the loader and
the batch-order contract. Never imports the PS side: what both agree on is in
psrpc/cluster/wire.py."""
