"""XpuPlatform capabilities, against a stubbed torch.xpu and look-alike triton installs."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

from omnirun.devices.xpu.platform import XpuPlatform, xpu_graph_api
from omnirun.errors import DeviceUnavailableError

# A triton whose import would fail the test: the platform must only look at it on disk.
IMPORT_TRAP = "raise AssertionError('omnirun imported triton while probing for it')\n"


def test_bf16_device(fake_xpu) -> None:
    fake_xpu.current = 1
    caps = XpuPlatform().capabilities
    assert caps.device_name == "Intel(R) Data Center GPU Max 1550"
    assert caps.model_dtypes == (torch.bfloat16, torch.float16, torch.float32)
    assert caps.bf16
    assert fake_xpu.called("get_device_properties") == [(1,)]  # the current device, not device 0


def test_device_without_native_bf16(fake_xpu) -> None:
    fake_xpu.properties.name = "Intel(R) UHD Graphics 770"
    fake_xpu.properties.has_bfloat16_conversions = False
    caps = XpuPlatform().capabilities
    assert caps.model_dtypes == (torch.float16, torch.float32)
    assert not caps.bf16


def test_fp8_is_the_ocp_flavour(fake_xpu) -> None:
    caps = XpuPlatform().capabilities
    assert caps.fp8
    assert (caps.fp8_e4m3_dtype, caps.fp8_e5m2_dtype) == (torch.float8_e4m3fn, torch.float8_e5m2)
    assert caps.kv_cache_dtypes[-2:] == (torch.float8_e4m3fn, torch.float8_e5m2)


def test_graph_api_follows_the_attributes(monkeypatch: pytest.MonkeyPatch, fake_xpu) -> None:
    # torch >= 2.11 has XPUGraph / graph / graph_pool_handle; earlier XPU builds lack them: eager decode.
    module = type("xpu", (), {"XPUGraph": object, "graph": object, "graph_pool_handle": object})
    api = xpu_graph_api(module)
    assert api.name == "xpu_graph" and api.new_graph is object
    delattr(module, "graph_pool_handle")
    assert xpu_graph_api(module) is None
    for name in ("XPUGraph", "graph", "graph_pool_handle"):
        monkeypatch.delattr(torch.xpu, name, raising=False)
    assert XpuPlatform().graph_api() is None


def test_no_triton_installed(monkeypatch: pytest.MonkeyPatch, fake_xpu) -> None:
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *args: None if name == "triton" else real_find_spec(name, *args)
    )
    platform = XpuPlatform()
    assert not platform.capabilities.supports_triton
    assert "triton" not in platform.attention_backends() and platform.attention_backends()[-1] == "torch_native"


@pytest.fixture
def triton_unimported(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forget a triton that other tests of this run imported, so "not imported by the probe" can be checked."""
    for name in [m for m in sys.modules if m == "triton" or m.startswith("triton.")]:
        monkeypatch.delitem(sys.modules, name)


def test_triton_with_intel_backend(
    monkeypatch: pytest.MonkeyPatch, tmp_path, fake_xpu, write_package, triton_unimported
) -> None:
    write_package(tmp_path, "triton", "pytorch-triton-xpu", "3.6.0", init=IMPORT_TRAP, subdirs=("backends/intel",))
    monkeypatch.syspath_prepend(tmp_path)
    platform = XpuPlatform()
    assert platform.capabilities.supports_triton
    # Listing the backends and ops must not import triton either (the gate reads capabilities only).
    assert platform.attention_backends()[0] == "triton" and platform.attention_backends()[-1] == "torch_native"
    assert platform.default_attention_backend("decode") == "triton"
    assert "triton" not in sys.modules


@pytest.mark.parametrize("intel_triton", [True, False])
def test_fp8_experts_stay_in_fp8_on_the_triton_kernels_where_triton_runs(
    monkeypatch: pytest.MonkeyPatch, fake_xpu, intel_triton
) -> None:
    """No IPEX here: fp8 experts on the portable Triton `fp8_fused_moe` (the OCP bits as stored), else dequantized."""
    pytest.importorskip("triton", reason="the portable Triton kernels need triton")
    from omnirun.devices.xpu import platform as xpu_module
    from omnirun.kernels.triton.moe import fp8_fused_moe
    from omnirun.layers.ops import resolve_ops, runs_fp8_experts

    monkeypatch.setattr(xpu_module, "_intel_triton_installed", lambda: intel_triton)
    ops = resolve_ops(XpuPlatform().fused_ops())
    assert runs_fp8_experts(ops) is intel_triton
    if intel_triton:
        assert ops.fp8_fused_moe.func is fp8_fused_moe and ops.fp8_fused_moe.keywords["fnuz"] is False


def test_generic_triton_cannot_compile_for_xpu(
    monkeypatch: pytest.MonkeyPatch, tmp_path, fake_xpu, write_package, triton_unimported
) -> None:
    write_package(tmp_path, "triton", "triton", "3.6.0", init=IMPORT_TRAP, subdirs=("backends/nvidia",))
    monkeypatch.syspath_prepend(tmp_path)
    assert not XpuPlatform().capabilities.supports_triton
    assert "triton" not in sys.modules


def test_capabilities_need_a_device(fake_xpu) -> None:
    fake_xpu.count = 0
    with pytest.raises(DeviceUnavailableError):
        XpuPlatform().capabilities  # noqa: B018 - the property access is the call under test
