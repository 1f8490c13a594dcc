"""The CUDA path (workers on cuda:{LOCAL_RANK % n}, pinned staging, CPU tensors over RPC, shards
on CPU). Skipped without CUDA; run on a GPU machine with `pytest -m gpu`."""

import pytest
import torch

from tests.conftest import assert_same_model, run_cluster

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("extra", [[], ["update.wire_dtype=bfloat16"], ["cluster.bucket_bytes=0"]])
def test_cuda_workers_train_like_cpu_workers(tmp_path, extra):
    cpu = run_cluster(tmp_path / "cpu", ["model=cnn", "train.device=cpu"] + extra)
    gpu = run_cluster(tmp_path / "gpu", ["model=cnn", "train.device=cuda"] + extra)
    assert gpu[0]["steps"] == cpu[0]["steps"] == 20
    tol = dict(rtol=1e-2, atol=1e-3) if extra else dict(rtol=1e-3, atol=1e-4)  # cuDNN vs CPU
    assert_same_model(gpu[1], cpu[1], **tol)


def test_cuda_model_parallel_stages(tmp_path):
    s, state = run_cluster(tmp_path, ["parallel=model", "model=cnn", "train.device=cuda"])
    assert s["steps"] == 20 and all(torch.isfinite(v).all() for v in state.values())
