"""RocmPlatform on a real AMD GPU; skipped, with the probe's reason, wherever none is visible. Never run here yet.

It checks the real platform class against the GPU, not the platform registered for --device rocm: in the rocm-fake
lane that one is FakeRocmPlatform (an MI300X made of CPU tensors), whose answers are the fake's, not a GPU's. So it
asks RocmPlatform's own probe, which on a CPU build of torch says why there is no GPU, and skips with that."""

from __future__ import annotations

import pytest
import torch

from omnirun.devices.rocm.platform import RocmPlatform

pytestmark = pytest.mark.device("rocm")

MiB = 1 << 20
FNUZ = (torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)
OCP = (torch.float8_e4m3fn, torch.float8_e5m2)
# fp8 per gfx target as AMD documents it (ROCm's precision-support table), written out here rather than asked of
# the code under test: the MI300 series compute in the FNUZ encodings, the MI350 series and RDNA4 in OCP's.
FP8_BY_TARGET = {"gfx940": FNUZ, "gfx941": FNUZ, "gfx942": FNUZ, "gfx950": OCP, "gfx1200": OCP, "gfx1201": OCP}


@pytest.fixture(scope="module")
def rocm() -> RocmPlatform:
    platform = RocmPlatform()
    probe = platform.probe()
    if not probe.available:
        pytest.skip(f"needs an AMD GPU: {probe.reason}")
    return platform


def test_capabilities_match_the_gpu(rocm: RocmPlatform):
    caps = rocm.capabilities
    gcn_arch_name = torch.cuda.get_device_properties(rocm.current_device()).gcnArchName
    assert caps.device_name.endswith(f"({gcn_arch_name.split(':')[0]})")
    assert rocm.graph_api().name == "hip_graph"
    target = gcn_arch_name.split(":")[0]
    assert (caps.fp8_e4m3_dtype, caps.fp8_e5m2_dtype) == FP8_BY_TARGET.get(target, (None, None))
    # Every advertised dtype really computes and converts on this GPU.
    ones = torch.ones(16, device=rocm.device())
    for dtype in caps.model_dtypes:
        assert (ones.to(dtype) * 2).sum().item() == 32
    for dtype in caps.kv_cache_dtypes:
        assert torch.equal(ones.to(dtype).float(), ones)
