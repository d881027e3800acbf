"""XpuPlatform device control and memory calls reach torch.xpu with the right device, against a stub."""

from __future__ import annotations

import pytest
import torch

from omnirun.devices.xpu.platform import XpuPlatform

GiB = 1 << 30


@pytest.fixture
def xpu(fake_xpu) -> XpuPlatform:
    return XpuPlatform()


def test_device_defaults_to_the_current_one(fake_xpu, xpu: XpuPlatform) -> None:
    fake_xpu.current = 1
    assert xpu.device() == torch.device("xpu", 1)
    assert xpu.device(0) == torch.device("xpu", 0)


def test_memory_info_asks_mem_get_info_for_the_current_device(fake_xpu, xpu: XpuPlatform) -> None:
    fake_xpu.current = 1
    assert xpu.memory_info() == (60 * GiB, 64 * GiB)
    assert fake_xpu.called("mem_get_info") == [(torch.device("xpu", 1),)]


def test_memory_info_of_a_named_device(fake_xpu, xpu: XpuPlatform) -> None:
    fake_xpu.current = 1
    xpu.memory_info(0)
    assert fake_xpu.called("mem_get_info") == [(torch.device("xpu", 0),)]


def test_integrated_gpu_without_free_memory_query_falls_back_to_its_limit(fake_xpu, xpu: XpuPlatform) -> None:
    fake_xpu.properties.name = "Intel(R) Graphics [0xb080]"
    fake_xpu.properties.is_integrated_gpu = True
    fake_xpu.properties.total_memory = 16 * GiB
    fake_xpu.reserved = 1 * GiB
    fake_xpu.mem_get_info_error = RuntimeError(
        "The device (Intel(R) Graphics [0xb080]) doesn't support querying the available free memory."
    )
    assert xpu.memory_info(0) == (15 * GiB, 16 * GiB)
    assert fake_xpu.called("memory_reserved") == [(torch.device("xpu", 0),)]


def test_discrete_gpu_memory_errors_are_not_hidden(fake_xpu, xpu: XpuPlatform) -> None:
    fake_xpu.mem_get_info_error = RuntimeError("UR_RESULT_ERROR_DEVICE_LOST")
    with pytest.raises(RuntimeError, match="DEVICE_LOST"):
        xpu.memory_info()


def test_peak_memory_of_the_named_device(fake_xpu, xpu: XpuPlatform) -> None:
    fake_xpu.peak = 3 * GiB
    assert xpu.peak_memory_allocated(1) == 3 * GiB
    xpu.reset_peak_memory(1)
    assert fake_xpu.called("max_memory_allocated") == [(torch.device("xpu", 1),)]
    assert fake_xpu.called("reset_peak_memory_stats") == [(torch.device("xpu", 1),)]


def test_empty_cache(fake_xpu, xpu: XpuPlatform) -> None:
    xpu.empty_cache()
    assert fake_xpu.called("empty_cache") == [()]


def test_set_device_and_synchronize(fake_xpu, xpu: XpuPlatform) -> None:
    xpu.set_device(1)
    xpu.synchronize(1)
    xpu.synchronize()
    assert fake_xpu.called("set_device") == [(1,)]
    assert fake_xpu.called("synchronize") == [(1,), (None,)]


def test_stream_on_the_named_device_and_timing_event(fake_xpu, xpu: XpuPlatform) -> None:
    assert xpu.stream(1) == ("stream", torch.device("xpu", 1))
    assert xpu.event(enable_timing=True) == ("event", True)


def test_manual_seed_seeds_host_and_every_xpu(fake_xpu, xpu: XpuPlatform) -> None:
    xpu.manual_seed(1234)
    assert torch.initial_seed() == 1234
    # torch.manual_seed seeds the XPUs of an XPU build too; whoever does it, every call carries the seed.
    seeds = fake_xpu.called("manual_seed_all")
    assert seeds and set(seeds) == {(1234,)}
