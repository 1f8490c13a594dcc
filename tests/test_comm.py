"""psrpc/cluster/comm.py's choices about TensorPipe, checked without starting RPC."""

import pytest
import torch
import torch.distributed.rpc as rpc

from psrpc.cluster import comm


def test_only_cpu_channels_whether_cuda_is_visible_or_not(monkeypatch):
    """With CUDA visible TensorPipe adds CUDA channels, and cuda_ipc aborts the handshake between
    hosts (PyTorch issue 95487): init_rpc gets CPU channels only, PSRPC_TP_CHANNELS' in
    TensorPipe's order (cma, basic by default: no mpt_uv), and the uv transport."""
    seen, real = {}, rpc.TensorPipeRpcBackendOptions

    def options(**kwargs):  # torch checks every channel name here ("Unknown channel: ...")
        seen.update(kwargs)
        return real(**kwargs)

    monkeypatch.setattr(comm.rpc, "TensorPipeRpcBackendOptions", options)
    monkeypatch.setattr(comm.rpc, "init_rpc", lambda *args, **kwargs: None)
    for cuda in (True, False):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
        for names, channels in ((None, ["cma", "basic"]), ("basic,cma", ["cma", "basic"]),
                                ("mpt_uv,basic,cma", ["cma", "mpt_uv", "basic"])):
            if names is None:
                monkeypatch.delenv("PSRPC_TP_CHANNELS", raising=False)
            else:
                monkeypatch.setenv("PSRPC_TP_CHANNELS", names)
            comm.init("ps0", 0, 1, "127.0.0.1", 1, rpc_timeout_s=60, init_timeout_s=10)
            assert seen["_channels"] == channels
            assert seen["_transports"] == ["uv"] and seen["num_worker_threads"] == 16


def test_an_rpc_is_answered_only_while_the_group_that_asked_lasts(monkeypatch):
    """A Future an RPC returned (a checkpoint's file info, a round's reply) that completes
    after this process left that group (a membership epoch ended) is not answered: torch's
    agent, shut down by then, would send it from freed memory. One completed in time is."""
    @comm.async_execution
    def later(fut):
        return fut

    monkeypatch.setattr(comm, "_on_leave", [])  # (leaving, here, runs none of this process's hooks)
    in_time, late = torch.futures.Future(), torch.futures.Future()
    answered, dropped = later(in_time), later(late)
    in_time.set_result(1)
    comm._left()  # the group ends
    late.set_result(2)
    assert answered.wait() == 1 and not dropped.done()
    assert getattr(later, "_wrapped_async_rpc_function", None) is not None  # still async RPC
