"""XpuPlatform's IPEX parts and graph runner choice, on a stubbed torch.xpu with the fake IPEX installed or not."""

from __future__ import annotations

import pytest
import torch

from omnirun.assembly import assemble
from omnirun.config import RunnerConfig
from omnirun.devices.xpu.platform import XpuPlatform
from omnirun.env_report import platform_row, to_table
from omnirun.layers import native_ops
from omnirun.layers.ops import resolve_ops, runs_fp8_weights, runs_int4_weights


@pytest.fixture
def no_triton(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr("omnirun.devices.xpu.platform._intel_triton_installed", lambda: False)


def test_matching_ipex_is_offered_on_request(fake_xpu, install_ipex, no_triton) -> None:
    install_ipex("xpu")
    platform = XpuPlatform()
    assert platform.attention_backends() == ("ipex", "torch_native")
    # On request only: torch_native stays the default where triton does not run.
    assert platform.default_attention_backend("decode") == "torch_native"
    quantized = [
        "fp8_linear",
        "int4_linear",
        "prepare_fp8_linear",
        "prepare_int4_linear",
        "fp8_linear_takes",
        "int4_linear_takes",
    ]
    fused = ["add_rms_norm", *quantized, "rms_norm", "rotary_embedding", "silu_and_mul"]
    assert sorted(platform.device_fused_ops()) == sorted(fused)
    assert platform.notes() == ()


def test_ipex_s_quantized_linears_win_and_keep_triton_as_their_fallback(
    monkeypatch: pytest.MonkeyPatch, fake_xpu, install_ipex
) -> None:
    """The portable ops (Triton's int4_linear where triton runs) are the fallback IPEX's ops hand what IPEX cannot
    take; in the platform's table IPEX's replace them, and offering them makes layers keep quantized weights."""
    ipex = install_ipex("xpu")
    seen = []

    def portable_int4(x, *args):
        seen.append("triton")
        return native_ops.int4_linear(x, *args[:5])

    portable = {"int4_linear": portable_int4}
    monkeypatch.setattr("omnirun.devices.xpu.platform.portable_fused_ops", lambda capabilities: portable)
    monkeypatch.setattr("omnirun.kernels.portable_fused_ops", lambda capabilities: portable)
    platform = XpuPlatform()
    ops = resolve_ops(platform.fused_ops())
    assert ops.int4_linear is not portable_int4 and runs_int4_weights(ops) and runs_fp8_weights(ops)
    gen = torch.Generator().manual_seed(0)
    packed = torch.randint(-(2**31), 2**31, (16, 16), generator=gen, dtype=torch.int64).to(torch.int32)
    scale, zero = torch.full((16, 8), 0.01), torch.full((16, 8), 8, dtype=torch.uint8)
    x = torch.randn(2, 128, dtype=torch.bfloat16)
    assert ops.prepare_int4_linear(packed, scale, zero, 16) is None  # groups of 16: not IPEX's
    ops.int4_linear(x, packed, scale, zero, None, 16, None)
    assert seen == ["triton"] and ipex.calls["IPEXWeightOnlyQuantizedLinear.forward"] == 0
    scale, zero = scale[:, :1], zero[:, :1]
    prepared = ops.prepare_int4_linear(packed, scale, zero, 128)
    ops.int4_linear(x, packed, scale, zero, None, 128, prepared)
    assert seen == ["triton"] and ipex.calls["IPEXWeightOnlyQuantizedLinear.forward"] == 1
    quantized = platform_row(platform).quantized
    assert "kept packed for int4_linear" in quantized and "kept in fp8 for fp8_linear" in quantized


def test_ipex_without_quantized_linears_leaves_them_dequantized(
    monkeypatch: pytest.MonkeyPatch, fake_xpu, install_ipex, no_triton
) -> None:
    ipex = install_ipex("xpu")
    del ipex.llm.quantization  # as before v2.5.10+xpu; the fp8 GEMM came with v2.8.10+xpu
    monkeypatch.delattr(torch.ops.torch_ipex, "fp8_gemm_w8a16")
    ops = resolve_ops(XpuPlatform().fused_ops())
    assert not runs_int4_weights(ops) and not runs_fp8_weights(ops)


def test_ipex_comes_after_triton(monkeypatch: pytest.MonkeyPatch, fake_xpu, install_ipex) -> None:
    install_ipex("xpu")
    monkeypatch.setattr("omnirun.devices.xpu.platform._intel_triton_installed", lambda: True)
    platform = XpuPlatform()
    assert platform.attention_backends() == ("triton", "ipex", "torch_native")
    assert platform.default_attention_backend("prefill") == "triton"


def test_mismatched_ipex_falls_back_and_env_says_why(
    monkeypatch: pytest.MonkeyPatch, fake_xpu, install_ipex, no_triton
) -> None:
    module = install_ipex("xpu", "2.8.10+xpu")
    module.llm = None  # importing it would have exited the process: nothing of it may be touched
    platform = XpuPlatform()
    assert platform.attention_backends() == ("torch_native",)
    assert platform.device_fused_ops() == {}
    found = ".".join(torch.__version__.split(".")[:2])
    reason = f"ipex: intel-extension-for-pytorch 2.8.10+xpu needs torch 2.8, found {found}"
    assert platform.notes() == (reason,)
    row = platform_row(platform)
    assert row.notes == [reason] and reason in " ".join(to_table([row], None).split())
    assert row.packages["intel-extension-for-pytorch"] == "2.8.10+xpu"


def _graphs(platform: XpuPlatform, decode: str | None, head_dim: int) -> str | None:
    """The graph API a bf16 runner with this decode backend would capture with here (None: eager)."""
    config = RunnerConfig(model="stand-in", decode_attention_backend=decode)  # loads nothing
    return assemble(config, platform, torch.bfloat16, 8, head_dim).graphs


def test_graph_runner_only_for_capturable_decode(monkeypatch: pytest.MonkeyPatch, fake_xpu, install_ipex) -> None:
    install_ipex("xpu")
    for name in ("XPUGraph", "graph", "graph_pool_handle"):
        monkeypatch.setattr(torch.xpu, name, object, raising=False)
    monkeypatch.setattr("omnirun.devices.xpu.platform._intel_triton_installed", lambda: True)
    platform = XpuPlatform()
    assert _graphs(platform, None, 64) == "xpu_graph"  # triton, the default, captures
    assert _graphs(platform, "torch_native", 64) is None
    assert _graphs(platform, "ipex", 128) == "xpu_graph"
    assert _graphs(platform, "ipex", 80) is None  # IPEX pads 80 through a host sync
