"""The CUDA path (workers on cuda:{LOCAL_RANK % n}, shared-memory slots registered with CUDA or
pinned staging, CPU tensors over RPC, shards on CPU): a run with CUDA workers ends where the same config ends with CPU workers, within the
tolerances below, with TF32 off on both (train.tf32=false: full float32 on the GPU too).

The `gpu` tests skip without CUDA; `pytest -m gpu` runs them on a machine that has it, and
`python -m benchmarks.gpu_check` runs them with a timing of CUDA against CPU workers
(docs/gpu.md). The tests without the marker run everywhere: every GPU case's overrides compose
and validate on CPU (a typo cannot hide behind the skip), and the rest of the suite stays on CPU.
"""

import math

import pytest
import torch

from psrpc.worker.replica import pick_device
from tests.conftest import CPU, FAST, compose, on_cpu, run_cluster

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
FP32 = ["train.tf32=false"]  # TF32 would round matmul/conv inputs to 10 mantissa bits

# name -> (overrides, tolerance of CUDA against CPU). In float32 the two differ by the order in
# which cuBLAS/cuDNN and the CPU kernels sum (about 1e-7 relative per operation), which 20 SGD
# steps with momentum grow to about 1e-5; the tolerances leave 10x room. bfloat16 on the wire
# rounds gradients to 8 bits, so a last-bit difference can flip one rounding: 1e-2. resnet18's
# BatchNorm divides by batch statistics of 8 samples, which amplifies differences: 1e-2 on 5 steps.
F32_TOL = dict(rtol=1e-3, atol=1e-4)
LOOSE_TOL = dict(rtol=1e-2, atol=1e-3)
CASES = {
    # cnn's 8 tensors in ~64 KiB buckets: several shards, each pushed while backward goes on
    # (shared memory with the PS: the default on one host; views in sync, slots in async)
    "buckets": (["model=cnn", "cluster.num_ps=2", "cluster.bucket_bytes=65536"], F32_TOL),
    "buckets_tcp": (["model=cnn", "cluster.num_ps=2", "cluster.bucket_bytes=65536",
                     "cluster.shm=off"], F32_TOL),  # pinned staging buffers instead
    "bf16_wire": (["model=cnn", "update.wire_dtype=bfloat16"], LOOSE_TOL),
    "model_parallel": (["parallel=model", "model=cnn", "cluster.num_workers=2"], F32_TOL),
    "resnet18_batchnorm": (["model=resnet18", "data.image_shape=[3,32,32]", "train.steps=5",
                            "train.batch_size=8", "train.log_every=5", "optim.lr=0.01"],
                           LOOSE_TOL),
    "async": (["update=async", "cluster.num_workers=1", "model=cnn"], F32_TOL),  # W=1: ordered
    # the dense part on the workers, all-reduced (NCCL with a GPU each, else gloo on CUDA)
    "dense_allreduce": (["model=cnn", "update.dense=allreduce"], F32_TOL),
}
NAN_CASE = ["model=cnn", "cluster.num_workers=2", "fault.nan_worker=1", "fault.nan_at_step=5"]


def _differences(a: dict, b: dict) -> tuple[float, float]:
    """Over every floating tensor: the largest |a - b|, and the largest |a - b| relative to
    the tensor's largest |b| (its scale)."""
    abs_diff = rel_diff = 0.0
    for k in a:
        if a[k].is_floating_point() and a[k].numel():
            d = (a[k].double() - b[k].double()).abs().max().item()
            abs_diff = max(abs_diff, d)
            rel_diff = max(rel_diff, d / max(b[k].double().abs().max().item(), 1e-30))
    return abs_diff, rel_diff


@pytest.mark.gpu
@pytest.mark.timeout(600)
@needs_cuda
@pytest.mark.parametrize("name", sorted(CASES))
def test_cuda_workers_train_like_cpu_workers(tmp_path, record_property, name):
    overrides, tol = CASES[name]
    cpu_summary, cpu_state = run_cluster(tmp_path / "cpu", overrides + FP32 + [CPU])
    gpu_summary, gpu_state = run_cluster(tmp_path / "gpu",
                                         overrides + FP32 + ["train.device=cuda"])
    abs_diff, rel_diff = _differences(gpu_state, cpu_state)
    record_property("max_abs_diff", abs_diff)  # gpu_check reports them
    record_property("max_rel_diff", rel_diff)
    assert gpu_summary["steps"] == cpu_summary["steps"] == (5 if "resnet18" in name else 20)
    if name == "buckets":
        assert len(gpu_summary["shards"]) >= 3
    assert gpu_state.keys() == cpu_state.keys()  # resnet18: BatchNorm statistics too
    for k in cpu_state:
        torch.testing.assert_close(gpu_state[k], cpu_state[k], **tol,
                                   msg=lambda m: f"{name}, {k}: {m}")


@pytest.mark.gpu
@pytest.mark.timeout(300)
@needs_cuda
def test_nan_from_a_cuda_worker_is_rejected(tmp_path):
    summary, state = run_cluster(tmp_path, NAN_CASE + ["train.device=cuda"])
    assert summary["steps"] == 20 and summary["nan_rejected"] >= 1
    assert all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point())
    assert math.isfinite(summary["final_loss"])


@pytest.mark.gpu
@needs_cuda
def test_a_failed_page_lock_leaves_no_cuda_error_behind():
    """Page-locking a shared-memory segment twice fails (already registered); that failure
    must not stay as CUDA's last error, which torch's check after the next kernel launch would
    raise against unrelated code."""
    from psrpc.worker.flat import _pinned

    host = torch.zeros(1 << 16).share_memory_()
    _pinned(host)
    _pinned(host)  # fails: already registered
    assert int(torch.cuda.cudart().cudaGetLastError()) == 0
    assert torch.ones(8, device="cuda").sum().item() == 8.0
    torch.cuda.cudart().cudaHostUnregister(host.data_ptr())


@pytest.mark.parametrize("overrides", [c[0] + FP32 for c in CASES.values()] + [NAN_CASE],
                         ids=list(CASES) + ["nan"])
def test_gpu_case_overrides_compose_on_cpu(monkeypatch, overrides):
    """Exactly what the gpu tests run, composed and validated here (CUDA faked for validate)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cfg = compose(FAST + overrides + ["train.device=cuda"])
    assert cfg.train.device == "cuda"
    assert cfg.train.steps == (5 if "model=resnet18" in overrides else 20)


def test_the_cpu_suite_stays_on_cpu(monkeypatch):
    """train.device=auto would put every worker of the suite on the GPU of a CUDA machine."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cfg = compose(FAST)
    assert cfg.train.device == "cpu" and pick_device(cfg.train.device, 0).type == "cpu"
    assert on_cpu(["-m", "update=sync,async"])[-1] == CPU  # the command-line helper too
    assert on_cpu(["train.device=cuda"]) == ["train.device=cuda"]


def test_train_tf32_sets_matmul_and_cudnn():
    from psrpc.process import set_tf32

    flags = [torch.backends.cuda.matmul, torch.backends.cudnn]
    before = [f.allow_tf32 for f in flags]
    try:  # by hand, not monkeypatch: these are torch's flag objects, not plain attributes
        set_tf32(None)  # torch's defaults stay
        assert [f.allow_tf32 for f in flags] == before
        for value in (False, True):
            set_tf32(value)
            assert [f.allow_tf32 for f in flags] == [value, value]
    finally:
        for f, value in zip(flags, before):
            f.allow_tf32 = value
    assert compose(["train.tf32=false"]).train.tf32 is False
