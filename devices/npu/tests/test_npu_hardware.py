"""NpuPlatform on a real Ascend NPU. Skipped, with the probe's reason, wherever no NPU is usable."""

from __future__ import annotations

import pytest
import torch

from omnirun.registry import get_platform

MIB = 1 << 20

pytestmark = pytest.mark.device("npu")


@pytest.fixture
def npu():
    return get_platform("npu")


def test_probe_finds_devices(npu):
    probe = npu.probe()
    assert probe.available and probe.device_count >= 1


def test_capabilities_name_an_ascend_soc(npu):
    caps = npu.capabilities
    assert caps.device_name.startswith("Ascend")
    assert torch.float16 in caps.model_dtypes and caps.graph_capture == "npu_graph"


def test_memory_info_is_sane(npu):
    free, total = npu.memory_info()
    assert 0 < free <= total


def test_peak_memory_grows_with_an_allocation_and_resets(npu):
    npu.reset_peak_memory()
    before = npu.peak_memory_allocated()
    block = torch.empty(64 * MIB, dtype=torch.uint8, device=npu.device())
    grown = npu.peak_memory_allocated()
    assert grown >= before + 64 * MIB
    del block
    npu.empty_cache()
    npu.reset_peak_memory()
    assert npu.peak_memory_allocated() < grown


def test_stream_and_event_order_and_time_work(npu):
    x = torch.ones(1024, 1024, device=npu.device())
    stream = npu.stream()
    start, end = npu.event(enable_timing=True), npu.event(enable_timing=True)
    stream.wait_stream(npu.device_module.current_stream())  # x was written on the default stream
    with npu.device_module.stream(stream):
        start.record(stream)
        y = x @ x
        end.record(stream)
    end.synchronize()
    assert stream.query()
    assert start.elapsed_time(end) >= 0
    assert y[0, 0].item() == 1024


def test_manual_seed_makes_device_sampling_repeatable(npu):
    npu.manual_seed(7)
    first = torch.randn(16, device=npu.device())
    npu.manual_seed(7)
    assert torch.equal(first, torch.randn(16, device=npu.device()))
