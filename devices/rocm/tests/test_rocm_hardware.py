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


@pytest.mark.parametrize("block", [None, (128, 128)], ids=["per-channel", "block"])
def test_fp8_linear_on_real_aiter_matches_the_reference(rocm: RocmPlatform, block):
    """The fp8 GEMMs and quantizers of the installed aiter (never run by this project yet), and the Triton
    weight-only kernel for decode rows, against the torch reference: the W8A8 tolerance of test_aiter_fp8.py."""
    from omnirun.layers import native_ops

    fused = rocm.fused_ops()
    if "fp8_linear" not in fused:
        pytest.skip("no fp8_linear here: aiter is not installed, or this GPU has no fp8 GEMMs in it")
    device = rocm.device()
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(256, 512, generator=gen) * 40).clamp(-448, 448).to(torch.float8_e4m3fn).to(device)
    shape = (256,) if block is None else (2, 4)
    scale = (torch.rand(*shape, generator=gen) * 1e-2 + 1e-3).to(device)
    prepared = fused["prepare_fp8_linear"](weight, scale, block)
    for rows in (1, 8, 64):
        x = torch.randn(rows, 512, generator=gen).to(device, torch.bfloat16)
        got = fused["fp8_linear"](x, weight, scale, None, block, prepared).float()
        expected = native_ops.fp8_linear(x, weight, scale, None, block).float()
        assert float((got - expected).norm() / expected.norm()) < 0.05, rows
