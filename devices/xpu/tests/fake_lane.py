"""The xpu-fake lane: XpuPlatform's real code (ipex attention and fused ops, XPU graph API, capabilities) over a fake
IPEX and an Intel Data Center GPU Max 1550 made of CPU tensors. `ci/run-lane xpu-fake` installs it as a registry hook
in every process (tests/support/omnirun_fakes/lane.py).

The fake IPEX matches this torch (a hypothetical 2.13.10+xpu: IPEX's last release pins torch 2.10), so the
platform's own version check offers the `ipex` backend and IPEX's fused ops. The subclass overrides only what a GPU
would answer: the probe, the device properties, device control and memory of the host standing in for the GPU,
and the graph module (torch.xpu's XPUGraph / graph / graph_pool_handle replaced by the recording graph, handed to
the platform's real `xpu_graph_api`). It also makes ipex the default for bf16/fp16 models: on real XPUs ipex is
offered on request only (triton or torch_native stays the default), but this lane exists to run ipex.
"""

from __future__ import annotations

import dataclasses
import sys
import tempfile
import types
from pathlib import Path

import torch

from omnirun.devices.xpu.platform import XpuPlatform, xpu_graph_api
from omnirun.facts import AttentionOffer, Capabilities, GraphAPI, ProbeResult
from omnirun.registry import PlatformRegistry
from omnirun_fakes.device import HostStandsInForDevice, RecordingGraph, new_pool, recording_capture

sys.path.insert(0, str(Path(__file__).resolve().parent))  # fake_ipex sits beside this file, outside any package
from fake_ipex import install_metadata, make_ipex, matching_version  # noqa: E402

FAKE_DEVICE = "Intel(R) Data Center GPU Max 1550"
# The fake GPU's memory: small, so that runners sized by the memory probe keep small KV pools.
# torch.xpu's graph API with the recording graph in place of torch's (absent on this CPU build of torch).
RECORDING_XPU_GRAPHS = types.SimpleNamespace(
    XPUGraph=RecordingGraph, graph=recording_capture, graph_pool_handle=new_pool
)


class FakeXpuPlatform(HostStandsInForDevice, XpuPlatform):
    torch_device_type = "cpu"
    distributed_backend = "gloo"

    def _probe(self) -> ProbeResult:
        return ProbeResult.ok(1)

    def _device_properties(self) -> types.SimpleNamespace:
        # torch.xpu.get_device_properties() of a Max 1550: the fields the platform reads.
        return types.SimpleNamespace(
            name=FAKE_DEVICE,
            has_fp16=True,
            has_bfloat16_conversions=True,
            is_integrated_gpu=False,
            total_memory=HostStandsInForDevice.fake_total_bytes,
        )

    def _capabilities(self) -> Capabilities:
        # No triton: CPU tensors run Triton kernels only in its interpreter, far too slow for the conformance suite
        # (and a recorded graph cannot replay them); ipex and torch_native are what this lane exercises.
        return dataclasses.replace(super()._capabilities(), supports_triton=False)

    def graph_api(self) -> GraphAPI | None:
        return xpu_graph_api(RECORDING_XPU_GRAPHS)

    def attention_offers(self) -> tuple[AttentionOffer, ...]:
        # This lane's choice (see the module docstring): ipex as the default wherever it computes (bf16/fp16).
        return tuple(dataclasses.replace(offer, on_request=False) for offer in super().attention_offers())


def install(registry: PlatformRegistry) -> None:
    """The lane's registry hook (tests/support/omnirun_fakes/lane.py)."""
    version = matching_version("xpu")
    ipex = make_ipex("xpu", version)
    sys.modules["intel_extension_for_pytorch"] = ipex
    for name, op in ipex.torch_ops.items():  # what importing IPEX registers on torch.ops.torch_ipex
        setattr(torch.ops.torch_ipex, name, op)
    # The distribution metadata pip would have written, where importlib.metadata finds it.
    root = tempfile.mkdtemp(prefix="omnirun-fake-ipex-")
    install_metadata(root, version)
    sys.path.append(root)
    registry.register(FakeXpuPlatform())
