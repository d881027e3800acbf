"""XpuPlatform on a real Intel GPU; skipped with the probe's reason wherever none is available."""

from __future__ import annotations

import pytest
import torch

from omnirun.devices.xpu.platform import XpuPlatform

pytestmark = pytest.mark.device("xpu")

MiB = 1 << 20


@pytest.fixture(scope="module")
def xpu() -> XpuPlatform:
    return XpuPlatform()


def test_probe_and_capabilities(xpu: XpuPlatform) -> None:
    probe = xpu.probe()
    assert probe.available, probe.reason
    assert probe.device_count >= 1
    caps = xpu.capabilities
    assert caps.device_name
    assert torch.float32 in caps.model_dtypes


def test_memory_info(xpu: XpuPlatform) -> None:
    free, total = xpu.memory_info()
    assert 0 < free <= total


def test_peak_memory_grows_with_an_allocation_and_resets(xpu: XpuPlatform) -> None:
    xpu.synchronize()
    xpu.reset_peak_memory()
    before = xpu.peak_memory_allocated()
    block = torch.empty(64 * MiB, dtype=torch.uint8, device=xpu.device())
    xpu.synchronize()
    with_block = xpu.peak_memory_allocated()
    assert with_block >= before + 64 * MiB
    del block
    xpu.empty_cache()
    xpu.reset_peak_memory()
    assert xpu.peak_memory_allocated() <= with_block - 64 * MiB


def test_stream_and_timed_events(xpu: XpuPlatform) -> None:
    stream = xpu.stream()
    start, end = xpu.event(enable_timing=True), xpu.event(enable_timing=True)
    x = torch.ones(1024, 1024, device=xpu.device())
    with torch.xpu.stream(stream):
        start.record(stream)
        y = x @ x
        end.record(stream)
    end.synchronize()
    assert start.elapsed_time(end) >= 0
    assert torch.equal(y.cpu(), torch.full((1024, 1024), 1024.0))
