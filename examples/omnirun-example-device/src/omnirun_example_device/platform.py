"""The example device's Platform: the hooks a vendor fills in, in the order a bring-up needs them.

It computes on the host CPU (torch device type "cpu"), so it runs anywhere; what makes it a device of its own is
its name, its memory probe and its fused op. A real device swaps each answer for its driver's.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from omnirun.host_event import HostEvent
from omnirun.platform import Capabilities, Platform, ProbeResult
from omnirun_example_device.memory import FixedSizeMemory
from omnirun_example_device.ops import compiled_silu_and_mul

# How big the pretend device is; a real device reads this from its driver.
CAPACITY_ENV = "OMNIRUN_EXAMPLEDEV_MEMORY_GB"
DISABLE_ENV = "OMNIRUN_EXAMPLEDEV_DISABLE"


class ExampleDevicePlatform(Platform):
    # 1. Identity: the contract version this was written for (omnirun.facts.PLATFORM_API_VERSION, as a literal:
    # omnirun loads the previous version with a deprecation warning and refuses others; docs/platform-contract.md),
    # what the user types, the torch device type its tensors live on, and the collective backend.
    api_version = 2
    name = "exampledev"
    torch_device_type = "cpu"
    distributed_backend = "gloo"
    # Never chosen by --device auto over a real device (cpu is 0): only by name.
    auto_priority = -1

    # 2. Availability: cheap, never initialises the device, never raises; the reason says how to fix it.
    def _probe(self) -> ProbeResult:
        if os.environ.get(DISABLE_ENV):
            return ProbeResult.unavailable(f"{DISABLE_ENV} is set: unset it to use the example device")
        return ProbeResult.ok(1)

    # 3. Capabilities: facts the runner reads instead of asking which device it is on.
    def _capabilities(self) -> Capabilities:
        return Capabilities(
            device_name="omnirun example device (host CPU)",
            model_dtypes=(torch.float32, torch.bfloat16),
            fp8_e4m3_dtype=None,
            fp8_e5m2_dtype=None,
            supports_triton=False,
        )

    # 4. Device control: one device; the generic methods would ask torch.cpu, which has no device index.
    def device(self, index: int | None = None) -> torch.device:
        return torch.device("cpu")

    def current_device(self) -> int:
        return 0

    def set_device(self, index: int) -> None:
        if index != 0:
            raise ValueError(f"the example device has one device (index 0), not {index}")

    def synchronize(self, index: int | None = None) -> None:
        torch.cpu.synchronize()

    def stream(self, index: int | None = None) -> torch.Stream:
        return torch.Stream("cpu")

    def event(self, enable_timing: bool = False) -> HostEvent:
        return HostEvent(enable_timing)  # host work is done when it returns: a clock is event enough

    # 5. Memory: (free, total) of the device, read after the weights load to size the KV cache.
    def memory_info(self, index: int | None = None) -> tuple[int, int]:
        return self._memory.info()

    def empty_cache(self) -> None:
        pass  # the host allocator gives memory back by itself

    def peak_memory_allocated(self, index: int | None = None) -> int:
        return self._memory.capacity - self._memory.info()[0]

    def reset_peak_memory(self, index: int | None = None) -> None:
        pass

    # 6. Fused ops: the device's own kernels that replace the torch-native references, by op name (the portable
    # Triton kernels come on top where the capabilities say supports_triton).
    def device_fused_ops(self) -> dict[str, Callable[..., Any]]:
        return {"silu_and_mul": compiled_silu_and_mul()}

    # (7. attention_offers() and 8. graph_api() are optional: without them the runner uses torch_native attention
    # and runs every step eagerly.)

    @property
    def _memory(self) -> FixedSizeMemory:
        memory = self.__dict__.get("_fixed_memory")
        if memory is None:
            capacity = int(float(os.environ.get(CAPACITY_ENV, "4")) * 2**30)
            memory = self.__dict__["_fixed_memory"] = FixedSizeMemory(capacity)
        return memory
