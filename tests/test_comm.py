"""psrpc/cluster/comm.py's choices about TensorPipe, checked without starting RPC."""

import pytest
import torch
import torch.distributed.rpc as rpc

from psrpc.cluster import comm


def test_only_cpu_channels_whether_cuda_is_visible_or_not(monkeypatch):
    """With CUDA visible TensorPipe adds CUDA channels, and cuda_ipc aborts the handshake between
    hosts (PyTorch issue 95487): init_rpc gets CPU channels only, cluster.channels' in
    TensorPipe's order (cma, basic by default: no mpt_uv), or all three for null."""
    seen, real = {}, rpc.TensorPipeRpcBackendOptions

    def options(**kwargs):  # torch checks every channel name here ("Unknown channel: ...")
        seen.update(kwargs)
        return real(**kwargs)

    monkeypatch.setattr(comm.rpc, "TensorPipeRpcBackendOptions", options)
    monkeypatch.setattr(comm.rpc, "init_rpc", lambda *args, **kwargs: None)
    for cuda in (True, False):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
        for names, channels in ((["basic", "cma"], ["cma", "basic"]),
                                (None, ["cma", "mpt_uv", "basic"])):
            comm.init("ps0", 0, 1, "127.0.0.1", 1, rpc_timeout_s=60, init_timeout_s=10,
                      threads=4, transports=["uv"], channels_=names)
            assert seen["_channels"] == channels


def test_the_default_channels_leave_out_mpt_uv_and_a_bad_name_is_refused():
    from psrpc.errors import ConfigError
    from tests.conftest import compose

    assert compose([]).cluster.channels == ["cma", "basic"]
    with pytest.raises(ConfigError, match=r"cluster.channels=\['tcp'\]: must list TensorPipe "
                                          r"channels from \['cma', 'mpt_uv', 'basic'\]"):
        compose(["cluster.channels=[tcp]"])
