"""XpuPlatform on a real Intel GPU; skipped with the probe's reason wherever none is available."""

from __future__ import annotations

import pytest
import torch

from omnirun.devices.xpu.platform import XpuPlatform

pytestmark = pytest.mark.device("xpu")

MiB = 1 << 20


@pytest.fixture(scope="module")
def xpu() -> XpuPlatform:
    # The registered one: the real platform, or in the xpu-fake lane the fake device standing in for it.
    from omnirun.registry import default_registry

    return default_registry().platforms["xpu"]


def test_probe_and_capabilities(xpu: XpuPlatform) -> None:
    probe = xpu.probe()
    assert probe.available, probe.reason
    assert probe.device_count >= 1
    caps = xpu.capabilities
    assert caps.device_name
    assert torch.float32 in caps.model_dtypes
