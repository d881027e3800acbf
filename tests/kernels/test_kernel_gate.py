"""One rule offers the Triton kernels: capabilities that say triton get triton attention and the triton fused ops
alike, on every platform, in-tree or plugin; the GEMV and the argmax stay cuda's own."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: the gate hands out its kernels")

from omnirun.devices.cuda import gemv  # noqa: E402
from omnirun.devices.cuda.argmax import TritonArgmax  # noqa: E402
from omnirun.platform import Capabilities, Platform, ProbeResult  # noqa: E402
from omnirun.registry import default_registry  # noqa: E402

pytestmark = pytest.mark.triton
TRITON_OPS = {"rms_norm", "add_rms_norm", "silu_and_mul", "rotary_embedding"}


class PluginPlatform(Platform):
    """An out-of-tree device: it says nothing about triton beyond its capabilities."""

    api_version = 2
    name = "plugin"
    torch_device_type = "cpu"
    distributed_backend = "gloo"

    def _probe(self) -> ProbeResult:
        return ProbeResult.ok(1)


def _platform(name: str, supports_triton: bool) -> Platform:
    platform = PluginPlatform() if name == "plugin" else type(default_registry().get(name))()
    caps = Capabilities("stub", (torch.bfloat16, torch.float32), None, None, supports_triton=supports_triton)
    platform.__dict__["capabilities"] = caps  # a cached_property: set, not probed
    return platform


@pytest.mark.parametrize("name", ["cuda", "rocm", "xpu", "npu", "cpu", "plugin"])
@pytest.mark.parametrize("supports_triton", [True, False])
def test_attention_and_fused_ops_follow_the_one_capability(name, supports_triton):
    platform = _platform(name, supports_triton)
    assert (TRITON_OPS <= set(platform.fused_ops())) is supports_triton
    assert ("triton" in platform.attention_backends()) is supports_triton
    if not supports_triton:
        assert not TRITON_OPS & set(platform.fused_ops())


@pytest.mark.parametrize("name", ["cuda", "rocm", "xpu", "plugin"])
def test_the_gemv_and_the_argmax_are_cudas_own(name):
    ops = _platform(name, supports_triton=True).fused_ops()
    linear = ops.get("linear")
    assert (getattr(linear, "func", linear) is gemv.linear) is (name == "cuda")  # a partial where cuda uses PDL
    assert "linear" not in _platform(name, supports_triton=False).fused_ops()
    assert isinstance(ops.get("argmax"), TritonArgmax) is (name == "cuda")
