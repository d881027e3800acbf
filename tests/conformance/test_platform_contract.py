"""The platform contract every device must meet: `pytest tests/conformance --device <name>`.

A vendor bringing up a device (in-tree or as a plugin) runs this suite on its hardware; each CI lane runs it on
its own device. The `platform` fixture fails, rather than skips, when the lane's device is unavailable.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from omnirun.distributed import init_process_group
from omnirun.platform import Capabilities
from omnirun.registry import default_registry

MIB = 1 << 20


def test_probe_is_available_and_stable(platform):
    first, second = platform.probe(), platform.probe()
    assert first.available and first.reason == ""
    assert first == second
    assert first.device_count >= 1 and platform.device_count() == first.device_count


def test_probe_does_not_initialise_the_device(platform, device_name):
    # A fresh process, since this one may have initialised the device already.
    code = (
        "from omnirun.registry import get_platform\n"
        f"platform = get_platform({device_name!r})\n"
        "module = platform.device_module\n"
        "before = module.is_initialized()\n"
        "assert platform.probe().available\n"
        "print(before, module.is_initialized())\n"
    )
    before, after = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    assert after == before  # (torch.cpu counts as initialised from the start)


def test_identity(platform, device_name):
    assert platform.name == device_name
    assert default_registry().get(device_name) is platform
    assert torch.device(platform.torch_device_type).type == platform.torch_device_type
    assert platform.dispatch_key and platform.distributed_backend
    assert platform.visible_devices_env is None or platform.visible_devices_env.isupper()


def test_capabilities_record(platform):
    caps = platform.capabilities
    assert isinstance(caps, Capabilities) and platform.capabilities is caps  # computed once
    assert caps.device_name
    assert torch.float32 in caps.model_dtypes
    assert all(isinstance(d, torch.dtype) and d.is_floating_point for d in caps.model_dtypes)
    assert set(caps.model_dtypes) <= set(caps.kv_cache_dtypes)
    for fp8 in (caps.fp8_e4m3_dtype, caps.fp8_e5m2_dtype):
        assert fp8 is None or (fp8.itemsize == 1 and fp8.is_floating_point)


def test_tensors_in_every_model_and_kv_dtype(platform):
    ref = torch.linspace(-4, 4, 64)
    for dtype in platform.capabilities.kv_cache_dtypes:
        on_device = ref.to(platform.device(0)).to(dtype)
        assert on_device.device.type == platform.torch_device_type and on_device.dtype == dtype
        back = on_device.float().cpu()
        # Round-trip within the dtype's own precision (fp8 keeps 2-3 mantissa bits).
        assert torch.allclose(back, ref, rtol=0.25 if dtype.itemsize == 1 else 1e-2, atol=0.1)


def test_device_control(platform):
    platform.set_device(0)
    assert platform.current_device() == 0
    x = torch.ones(1024, device=platform.device())
    assert x.device == platform.device(0)
    platform.synchronize()
    platform.synchronize(0)


def test_work_on_a_platform_stream_is_timed_by_events(platform):
    x = torch.ones(256, 256, device=platform.device())
    stream = platform.stream()
    assert stream.device.type == platform.torch_device_type
    platform.synchronize()  # x was written on the default stream
    start, end = platform.event(enable_timing=True), platform.event(enable_timing=True)
    with stream:
        start.record(stream)
        y = x @ x
        end.record(stream)
    end.synchronize()
    assert end.query()
    assert start.elapsed_time(end) >= 0.0
    assert y[0, 0].item() == 256


def test_manual_seed_is_reproducible(platform):
    platform.manual_seed(1234)
    a = torch.randn(256, device=platform.device())
    platform.manual_seed(1234)
    b = torch.randn(256, device=platform.device())
    assert torch.equal(a, b)


def test_memory_probe(platform):
    free, total = platform.memory_info()
    assert isinstance(free, int) and isinstance(total, int)
    assert 0 < free <= total
    assert platform.memory_info(0)[1] == total
    platform.empty_cache()


def test_peak_memory_grows_with_an_allocation_and_resets(platform):
    platform.synchronize()
    platform.reset_peak_memory()
    before = platform.peak_memory_allocated()
    block = torch.ones(128 * MIB, dtype=torch.uint8, device=platform.device())
    platform.synchronize()
    with_block = platform.peak_memory_allocated()
    assert with_block >= before + 0.9 * block.numel()
    del block
    platform.empty_cache()
    platform.reset_peak_memory()
    assert platform.peak_memory_allocated() <= with_block - 0.5 * 128 * MIB


def test_world_size_one_all_reduce(platform, tmp_path):
    if dist.is_initialized():  # a ModelRunner built earlier in this process joined its own world-size-1 group
        dist.destroy_process_group()
    init_process_group(platform, init_method=f"file://{tmp_path / 'store'}")
    try:
        assert dist.get_backend() == platform.distributed_backend
        x = torch.arange(8, dtype=torch.float32, device=platform.device())
        dist.all_reduce(x)
        platform.synchronize()
        assert torch.equal(x.cpu(), torch.arange(8, dtype=torch.float32))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_attention_backends(platform, mode):
    offered = platform.attention_backends()
    assert "torch_native" in offered  # the reference backend runs on every device
    assert platform.default_attention_backend(mode) in offered


def test_factories_answer(platform):
    assert isinstance(dict(platform.fused_ops()), dict)
    assert all(callable(op) for op in platform.fused_ops().values())
