"""The npu-fake lane: NpuPlatform's real code (ascend attention, NPU graphs, fused ops, capabilities) over a fake
torch_npu and an Atlas A2 (Ascend910B3) made of CPU tensors. `ci/run-lane npu-fake` installs it as a registry hook in
every process (tests/support/omnirun_fakes/lane.py).

The subclass overrides only what the hardware would answer: the probe, the SoC facts torch.npu reports, and device
control and memory of the host standing in for the NPU. Everything it offers — the ascend backend (the default for
bf16/fp16 models), NPU graphs through the fake NPUGraph (recording graphs whose ATB host arguments are frozen at
capture and rewritten by update(), as on the device), torch_npu's fused ops — comes from NpuPlatform.
"""

from __future__ import annotations

import sys
from pathlib import Path

from omnirun.devices.npu.platform import NpuPlatform
from omnirun.facts import ProbeResult
from omnirun.registry import PlatformRegistry
from omnirun_fakes.device import HostStandsInForDevice

sys.path.insert(0, str(Path(__file__).resolve().parent))  # fake_torch_npu sits beside this file
from fake_torch_npu import make_fake_torch_npu  # noqa: E402

FAKE_SOC = "Ascend910B3"


class FakeNpuPlatform(HostStandsInForDevice, NpuPlatform):
    torch_device_type = "cpu"
    distributed_backend = "gloo"

    def _probe(self) -> ProbeResult:
        return ProbeResult.ok(1)

    def _soc(self) -> tuple[str, bool]:
        return FAKE_SOC, True


def install(registry: PlatformRegistry) -> None:
    """The lane's registry hook (tests/support/omnirun_fakes/lane.py)."""
    sys.modules["torch_npu"] = make_fake_torch_npu()
    registry.register(FakeNpuPlatform())
