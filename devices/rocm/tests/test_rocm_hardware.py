"""RocmPlatform on a real AMD GPU; skipped, with the probe's reason, wherever none is visible. Never run here yet."""

from __future__ import annotations

import pytest
import torch

from omnirun.devices.rocm.gfx_arch import GfxArch, fp8_dtypes
from omnirun.devices.rocm.platform import RocmPlatform

pytestmark = pytest.mark.device("rocm")

MiB = 1 << 20


@pytest.fixture(scope="module")
def rocm() -> RocmPlatform:
    return RocmPlatform()


def test_capabilities_match_the_gpu(rocm: RocmPlatform):
    caps = rocm.capabilities
    gcn_arch_name = torch.cuda.get_device_properties(rocm.current_device()).gcnArchName
    assert caps.device_name.endswith(f"({gcn_arch_name.split(':')[0]})")
    assert caps.graph_capture == "hip_graph"
    assert (caps.fp8_e4m3_dtype, caps.fp8_e5m2_dtype) == fp8_dtypes(GfxArch.parse(gcn_arch_name))
    # Every advertised dtype really computes and converts on this GPU.
    ones = torch.ones(16, device=rocm.device())
    for dtype in caps.model_dtypes:
        assert (ones.to(dtype) * 2).sum().item() == 32
    for dtype in caps.kv_cache_dtypes:
        assert torch.equal(ones.to(dtype).float(), ones)
