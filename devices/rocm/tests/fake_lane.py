"""The rocm-fake lane: RocmPlatform's real code (aiter attention and norms, graph runner, capabilities) over a fake
`aiter` and an MI300X (gfx942) made of CPU tensors. `ci/run-lane rocm-fake` installs it as a registry hook in every
process (tests/support/omnirun_fakes/lane.py).

The subclass overrides only what a GPU would answer: the probe, the device properties torch.cuda reports, device
control and memory of the host standing in for the GPU, and the graph API (below). Everything it offers — attention
backends, fused ops, fp8 flavours, the graph runner — comes from RocmPlatform. One choice is the lane's own: aiter is
the default attention backend for bf16/fp16 models here (RocmPlatform keeps it on request), so that the conformance
suite's half-dtype runs (graph replay vs eager, start-up from a bf16 checkpoint) go through aiter and HIP graphs;
float32 runs get RocmPlatform's default (torch_native here, without triton), as aiter computes in bf16/fp16 only.
"""

from __future__ import annotations

import dataclasses
import sys
import types
from pathlib import Path

from omnirun.devices.rocm.platform import RocmPlatform
from omnirun.facts import AttentionOffer, Capabilities, GraphAPI, ProbeResult
from omnirun.registry import PlatformRegistry
from omnirun_fakes.device import HostStandsInForDevice, recording_graph_api

sys.path.insert(0, str(Path(__file__).resolve().parent))  # fake_aiter sits beside this file, outside any package
from fake_aiter import make_aiter, modules  # noqa: E402

FAKE_GCN_ARCH = "gfx942:sramecc+:xnack-"  # an MI300X, as ROCm torch reports it


class FakeRocmPlatform(HostStandsInForDevice, RocmPlatform):
    torch_device_type = "cpu"
    distributed_backend = "gloo"
    # A recorded graph keeps every intermediate of its capture alive (a HIP graph reuses one pool), and the fake
    # decode kernel reads every partition of the context: graphs up to batch 8 keep the lane's memory and time small.
    max_graph_batch_size = 8

    def _probe(self) -> ProbeResult:
        return ProbeResult.ok(1)

    def _device_properties(self) -> types.SimpleNamespace:
        return types.SimpleNamespace(name="AMD Instinct MI300X", gcnArchName=FAKE_GCN_ARCH)

    def _capabilities(self) -> Capabilities:
        # No triton: CPU tensors run Triton kernels only in its interpreter, far too slow for the conformance suite
        # (and a recorded graph cannot replay them); aiter and torch_native are what this lane exercises.
        return dataclasses.replace(super()._capabilities(), supports_triton=False)

    def attention_offers(self) -> tuple[AttentionOffer, ...]:
        # This lane's choice: aiter as the default wherever it computes (bf16/fp16), not only on request.
        return tuple(dataclasses.replace(offer, on_request=False) for offer in super().attention_offers())

    def graph_api(self) -> GraphAPI:
        # HIP graphs are torch's own (torch.cuda.CUDAGraph on a ROCm build), not a vendor module to fake: the
        # recording graph stands in for them on CPU tensors.
        return recording_graph_api("hip_graph")


def install(registry: PlatformRegistry) -> None:
    """The lane's registry hook (tests/support/omnirun_fakes/lane.py)."""
    sys.modules.update(modules(make_aiter("gfx942")))
    registry.register(FakeRocmPlatform())
