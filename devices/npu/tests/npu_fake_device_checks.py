"""NpuPlatform against a fake torch_npu with devices: probe, capabilities, and the routing of every device call.

Run in a process of its own (test_npu_platform.py starts it): like `import torch_npu`, the fixture renames torch's
PrivateUse1 backend to "npu", which a process cannot undo and which makes torch.accelerator expect a PrivateUse1
runtime that is not there, breaking any other test that asks torch.accelerator.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from omnirun.devices.npu.platform import NpuPlatform


def _load_fake():
    spec = importlib.util.spec_from_file_location("fake_torch_npu", Path(__file__).with_name("fake_torch_npu.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


fake = _load_fake()
GIB = fake.GIB


@pytest.fixture
def npu(monkeypatch):
    """A fake torch.npu with two Atlas A2 devices, registered the way `import torch_npu` registers the real one."""
    torch.utils.rename_privateuse1_backend("npu")  # idempotent; what makes torch.device("npu") parse
    npu = fake.FakeNpu()
    monkeypatch.setitem(sys.modules, "torch_npu", fake.make_torch_npu(npu))
    monkeypatch.setattr(torch, "npu", npu, raising=False)
    torch.get_device_module.cache_clear()  # it caches the module per device name
    yield npu
    torch.get_device_module.cache_clear()


def test_probe_counts_devices_without_initialising_one(npu):
    platform = NpuPlatform()
    assert platform.probe().available
    assert platform.device_count() == 2
    assert platform.device_module is npu
    assert not npu.initialized


@pytest.mark.parametrize("visible", [None, "4,5"])
def test_probe_without_devices_names_the_driver_check_and_the_visibility_variable(npu, monkeypatch, visible):
    npu.count = 0
    if visible is None:
        monkeypatch.delenv("ASCEND_RT_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", visible)
    probe = NpuPlatform().probe()
    assert not probe.available and probe.device_count == 0
    assert "no Ascend NPU" in probe.reason and "npu-smi info" in probe.reason
    assert ("ASCEND_RT_VISIBLE_DEVICES='4,5'" in probe.reason) == (visible is not None)


def test_probe_answers_when_the_driver_query_raises(npu, monkeypatch):
    def broken_count():
        raise RuntimeError("drvGetDevNum failed, error code 87")

    monkeypatch.setattr(npu, "device_count", broken_count)
    probe = NpuPlatform().probe()
    assert not probe.available
    assert "RuntimeError: drvGetDevNum failed, error code 87" in probe.reason


BF16, F16, F32, E4M3, E5M2 = torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2


@pytest.mark.parametrize(
    ("device_name", "bf16", "model_dtypes", "fp8", "kv_cache_dtypes"),
    [
        ("Ascend910B3", True, (BF16, F16, F32), False, (BF16, F16, F32)),  # Atlas A2
        ("Ascend910_9392", True, (BF16, F16, F32), False, (BF16, F16, F32)),  # Atlas A3
        ("Ascend950PR_9579", True, (BF16, F16, F32), True, (BF16, F16, F32, E4M3, E5M2)),  # Ascend 950
        ("Ascend310P3", False, (F16, F32), False, (F16, F32)),  # Atlas 300I Duo
    ],
)
def test_capabilities_follow_the_soc(npu, device_name, bf16, model_dtypes, fp8, kv_cache_dtypes):
    npu.device_name, npu.bf16 = device_name, bf16
    npu.current = 1
    caps = NpuPlatform().capabilities
    assert caps.device_name == device_name
    assert ("get_device_name", 1) in npu.calls  # the name of the current device
    assert caps.model_dtypes == model_dtypes and caps.bf16 == bf16
    assert caps.fp8 == fp8
    assert caps.kv_cache_dtypes == kv_cache_dtypes
    assert caps.supports_triton is False


def test_memory_info_asks_mem_get_info_about_the_right_device(npu):
    platform = NpuPlatform()
    free, total = platform.memory_info(1)
    assert (free, total) == (40 * GIB, 64 * GIB) and type(free) is int and type(total) is int
    assert npu.calls[-1] == ("mem_get_info", torch.device("npu", 1))
    platform.set_device(1)
    platform.memory_info()
    assert npu.calls[-1] == ("mem_get_info", torch.device("npu", 1))


def test_device_control_routes_to_torch_npu(npu):
    platform = NpuPlatform()
    platform.set_device(1)
    assert npu.calls[-1] == ("set_device", 1)
    assert platform.current_device() == 1 and platform.device() == torch.device("npu", 1)
    platform.synchronize(0)
    assert npu.calls[-1] == ("synchronize", 0)
    assert platform.stream(0).device_index == 0
    assert platform.stream().device_index == 1
    assert platform.event(enable_timing=True).enable_timing


def test_cache_and_peak_memory_route_to_torch_npu(npu):
    platform = NpuPlatform()
    platform.empty_cache()
    assert npu.calls[-1] == ("empty_cache", None)
    assert platform.peak_memory_allocated(0) == 3 * GIB
    assert npu.calls[-1] == ("max_memory_allocated", torch.device("npu", 0))
    platform.reset_peak_memory(1)
    assert npu.calls[-1] == ("reset_peak_memory_stats", torch.device("npu", 1))


def test_manual_seed_seeds_host_and_every_npu(npu):
    NpuPlatform().manual_seed(1234)
    assert npu.calls[-1] == ("manual_seed_all", 1234)
    assert torch.initial_seed() == 1234
