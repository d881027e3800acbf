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
    assert torch.float16 in caps.model_dtypes
