"""The one gate for the portable kernels: what a platform is offered follows from its capabilities alone.

The Triton kernels (attention, KV store, norms, rotary, activation) live in `omnirun.kernels.triton`, which imports
triton; this module does not, so `import omnirun` stays free of it. Attention and fused ops ask the same question.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from omnirun.facts import Capabilities


def offers_triton(capabilities: Capabilities) -> bool:
    """Whether the Triton kernels are offered: the device says they compile and run there."""
    return capabilities.supports_triton


def portable_fused_ops(capabilities: Capabilities) -> dict[str, Callable[..., Any]]:
    """The portable fused kernels a device with these capabilities gets (none: the torch-native references)."""
    if not offers_triton(capabilities):
        return {}
    from omnirun.kernels.triton.ops import triton_fused_ops  # imports triton: only once a device says it runs it

    return triton_fused_ops(device_name=capabilities.device_name, fp8_e4m3_dtype=capabilities.fp8_e4m3_dtype)
