"""psrpc/cluster/comm.py's choices about TensorPipe, checked without starting RPC."""

import torch
import torch.distributed.rpc as rpc

from psrpc.cluster import comm


def test_only_cpu_channels_where_cuda_is_visible(monkeypatch):
    """With CUDA visible TensorPipe adds CUDA channels, and cuda_ipc aborts the handshake between
    hosts (PyTorch issue 95487): init_rpc gets the CPU channels only. Without CUDA, TensorPipe's
    defaults, untouched."""
    seen, real = {}, rpc.TensorPipeRpcBackendOptions

    def options(**kwargs):  # torch checks every channel name here ("Unknown channel: ...")
        seen.update(kwargs)
        return real(**kwargs)

    monkeypatch.setattr(comm.rpc, "TensorPipeRpcBackendOptions", options)
    monkeypatch.setattr(comm.rpc, "init_rpc", lambda *args, **kwargs: None)
    for cuda, channels in ((True, ["cma", "mpt_uv", "basic"]), (False, None)):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
        comm.init("ps0", 0, 1, "127.0.0.1", 1, rpc_timeout_s=60, init_timeout_s=10, threads=4,
                  transports=["uv"])
        assert seen["_channels"] == channels
