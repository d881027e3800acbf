"""CpuPlatform facts and the parts it overrides from the generic Platform."""

from __future__ import annotations

import pytest
import torch

from omnirun.devices.cpu.platform import CpuPlatform
from omnirun.platform import Platform
from omnirun.registry import default_registry


def test_registered_under_its_name_and_always_available():
    platform = default_registry().get("cpu")
    assert isinstance(platform, CpuPlatform)
    assert platform.probe().available and platform.probe().device_count == 1
    assert platform.distributed_backend == "gloo"
    # auto must prefer any accelerator, plugins included (default priority), over the host CPU.
    assert platform.auto_priority < Platform.auto_priority


def test_device_is_plain_cpu_so_tensors_compare_equal():
    platform = CpuPlatform()
    assert platform.device() == platform.device(0) == torch.empty(1).device


def test_capabilities():
    caps = CpuPlatform().capabilities
    assert set(caps.model_dtypes) == {torch.float32, torch.bfloat16, torch.float16}
    native_bf16 = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    assert caps.model_dtypes[0] == (torch.bfloat16 if native_bf16 else torch.float32)
    assert caps.kv_cache_dtypes[-2:] == (torch.float8_e4m3fn, torch.float8_e5m2)
    assert caps.bf16 and caps.fp8 and not caps.supports_triton
    assert CpuPlatform().graph_api() is None
    assert caps.device_name


def test_set_device_rejects_other_indices():
    platform = CpuPlatform()
    platform.set_device(0)
    with pytest.raises(ValueError, match="one device"):
        platform.set_device(1)
