"""CudaPlatform on a real NVIDIA GPU; skipped, with the probe's reason, wherever none is visible."""

from __future__ import annotations

import pytest
import torch

from omnirun.devices.cuda.platform import CudaPlatform

pytestmark = pytest.mark.device("cuda")

MiB = 1 << 20


@pytest.fixture(scope="module")
def cuda() -> CudaPlatform:
    return CudaPlatform()


def test_capabilities_match_the_gpu(cuda: CudaPlatform):
    caps = cuda.capabilities
    sm = torch.cuda.get_device_capability()
    assert caps.device_name == torch.cuda.get_device_name()
    assert cuda.graph_api().name == "cuda_graph"
    assert caps.bf16 is (sm >= (8, 0))  # H200 (sm90): True
    assert caps.fp8_e4m3_dtype is (torch.float8_e4m3fn if sm >= (8, 9) else None)  # sm90: e4m3fn
    # Every advertised dtype really computes and converts on this GPU.
    ones = torch.ones(16, device=cuda.device())
    for dtype in caps.model_dtypes:
        assert (ones.to(dtype) * 2).sum().item() == 32
    for dtype in caps.kv_cache_dtypes:
        assert torch.equal(ones.to(dtype).float(), ones)
