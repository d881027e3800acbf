"""XpuPlatform identity and probe(), against a stubbed torch.xpu."""

from __future__ import annotations

import pytest
import torch
import torch.distributed

from omnirun.devices.xpu.platform import XpuPlatform
from omnirun.errors import DeviceUnavailableError
from omnirun.facts import ProbeResult
from omnirun.registry import default_registry


def test_identity() -> None:
    platform = XpuPlatform()
    assert platform.name == "xpu"
    assert platform.torch_device_type == "xpu"
    assert platform.dispatch_key == "XPU"
    assert platform.visible_devices_env == "ZE_AFFINITY_MASK"
    assert platform.distributed_backend == "xccl"
    assert platform.extra == "xpu"
    assert platform.vendor_packages == ("pytorch-triton-xpu", "intel-extension-for-pytorch")
    assert platform.auto_priority == 80


def test_xccl_is_torchs_own_backend_for_xpu() -> None:
    assert torch.distributed.Backend.default_device_backend_map["xpu"] == XpuPlatform.distributed_backend


def test_registered_under_its_name() -> None:
    assert isinstance(default_registry().get("xpu"), XpuPlatform)


def test_cpu_build_of_torch_names_the_xpu_build_and_the_extra(monkeypatch: pytest.MonkeyPatch, fake_xpu) -> None:
    monkeypatch.setattr(torch._C, "_has_xpu", False)
    probe = XpuPlatform().probe()
    assert not probe.available
    assert probe.device_count == 0
    assert f"torch {torch.__version__} has no XPU support" in probe.reason
    assert "https://download.pytorch.org/whl/xpu" in probe.reason
    assert probe.reason.endswith('pip install "omnirun[xpu]"')
    assert "\n" not in probe.reason
    assert fake_xpu.called("device_count") == []  # a CPU build is never asked for devices


def test_real_cpu_build_here_is_unavailable_for_that_reason() -> None:
    if torch._C._has_xpu:
        pytest.skip("this torch is an XPU build")
    assert "has no XPU support" in XpuPlatform().probe().reason


def test_no_device_points_at_driver_and_level_zero(fake_xpu) -> None:
    fake_xpu.count = 0
    probe = XpuPlatform().probe()
    assert not probe.available
    assert "no Intel GPU is visible" in probe.reason
    assert "driver" in probe.reason and "Level Zero" in probe.reason
    assert "ZE_AFFINITY_MASK" not in probe.reason  # unset: nothing to blame
    assert "\n" not in probe.reason


def test_no_device_names_the_affinity_mask_when_set(monkeypatch: pytest.MonkeyPatch, fake_xpu) -> None:
    monkeypatch.setenv("ZE_AFFINITY_MASK", "3")
    fake_xpu.count = 0
    assert "ZE_AFFINITY_MASK='3'" in XpuPlatform().probe().reason


def test_visible_devices_make_it_available(fake_xpu) -> None:
    fake_xpu.count = 4
    platform = XpuPlatform()
    assert platform.probe() == ProbeResult.ok(4)
    assert platform.available
    assert platform.device_count() == 4


def test_probe_never_initialises_the_device(fake_xpu) -> None:
    assert XpuPlatform().probe().available
    assert [name for name, _ in fake_xpu.calls] == ["device_count"]


def test_probe_reports_a_failing_runtime_instead_of_raising(monkeypatch: pytest.MonkeyPatch, fake_xpu) -> None:
    def broken_device_count() -> int:
        raise RuntimeError("level_zero backend failed with error: 2147483646 (UR_RESULT_ERROR_UNKNOWN)")

    monkeypatch.setattr(torch.xpu, "device_count", broken_device_count)
    probe = XpuPlatform().probe()
    assert not probe.available
    assert "RuntimeError" in probe.reason and "UR_RESULT_ERROR_UNKNOWN" in probe.reason


def test_require_available_raises_with_the_probe_reason(fake_xpu) -> None:
    fake_xpu.count = 0
    with pytest.raises(DeviceUnavailableError, match="no Intel GPU is visible"):
        XpuPlatform().require_available()
