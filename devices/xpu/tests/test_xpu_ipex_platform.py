"""XpuPlatform's IPEX parts and graph runner choice, on a stubbed torch.xpu with the fake IPEX installed or not."""

from __future__ import annotations

import pytest
import torch

from omnirun.assembly import assemble
from omnirun.config import RunnerConfig
from omnirun.devices.xpu.platform import XpuPlatform
from omnirun.env_report import platform_row, to_table


@pytest.fixture
def no_triton(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr("omnirun.devices.xpu.platform._intel_triton_installed", lambda: False)


def test_matching_ipex_is_offered_on_request(fake_xpu, install_ipex, no_triton) -> None:
    install_ipex("xpu")
    platform = XpuPlatform()
    assert platform.attention_backends() == ("ipex", "torch_native")
    # On request only: torch_native stays the default where triton does not run.
    assert platform.default_attention_backend("decode") == "torch_native"
    assert sorted(platform.device_fused_ops()) == ["add_rms_norm", "rms_norm", "rotary_embedding", "silu_and_mul"]
    assert platform.notes() == ()


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
