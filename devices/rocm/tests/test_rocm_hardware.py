"""RocmPlatform on a real AMD GPU; skipped, with the probe's reason, wherever none is visible. Never run here yet."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from omnirun.devices.rocm.gfx_arch import GfxArch, fp8_dtypes
from omnirun.devices.rocm.platform import RocmPlatform

pytestmark = pytest.mark.device("rocm")

MiB = 1 << 20


@pytest.fixture(scope="module")
def rocm() -> RocmPlatform:
    return RocmPlatform()


def test_probe_finds_the_gpus_without_initialising_hip():
    # A fresh process: this one has initialised the GPU already, or will.
    code = (
        "import torch\n"
        "from omnirun.devices.rocm.platform import RocmPlatform\n"
        "probe = RocmPlatform().probe()\n"
        "print(probe.available, probe.device_count, torch.cuda.is_initialized())\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["True", str(torch.cuda.device_count()), "False"]


def test_memory_info_reports_free_within_total(rocm: RocmPlatform):
    free, total = rocm.memory_info()
    assert 0 < free <= total


def test_peak_memory_grows_with_an_allocation_and_resets(rocm: RocmPlatform):
    rocm.reset_peak_memory()
    before = rocm.peak_memory_allocated()
    block = torch.empty(64 * MiB, dtype=torch.uint8, device=rocm.device())
    assert rocm.peak_memory_allocated() >= before + 64 * MiB
    del block
    rocm.reset_peak_memory()
    assert rocm.peak_memory_allocated() < before + 64 * MiB


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


def test_events_time_work_on_a_platform_stream(rocm: RocmPlatform):
    stream = rocm.stream()
    start, end = rocm.event(enable_timing=True), rocm.event(enable_timing=True)
    a = torch.randn(2048, 2048, device=rocm.device())
    rocm.synchronize()
    with torch.cuda.stream(stream):
        start.record(stream)
        b = a @ a
        end.record(stream)
    end.synchronize()
    assert start.elapsed_time(end) > 0
    rocm.synchronize()
    assert b.shape == (2048, 2048)
