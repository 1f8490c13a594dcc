"""Plumbing every process of a run uses, whatever its role: who is who (topology, launchers),
the only module that calls torch.distributed.rpc (comm), membership epochs, shared memory,
where each parameter lives (layout) and the wire types workers and shards agree on."""
