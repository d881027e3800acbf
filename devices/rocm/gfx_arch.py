"""What an AMD GPU architecture supports, read from its gfx target (gcnArchName, e.g. "gfx942:sramecc+:xnack-")."""

from __future__ import annotations

from typing import NamedTuple

import torch


def gfx_target(gcn_arch_name: str) -> str:
    """The target without its feature flags: "gfx942:sramecc+:xnack-" -> "gfx942"."""
    return gcn_arch_name.split(":", 1)[0]


class GfxArch(NamedTuple):
    major: int
    minor: int
    stepping: int

    @classmethod
    def parse(cls, gcn_arch_name: str) -> GfxArch:
        """gfx942 -> (9, 4, 2), gfx90a -> (9, 0, 10), gfx1100 -> (11, 0, 0)."""
        target = gfx_target(gcn_arch_name)
        digits = target.removeprefix("gfx")
        # The last two characters are the minor version and the stepping, one hex digit each; the rest is the major.
        if digits == target or len(digits) < 3 or not digits[:-2].isdigit():
            raise ValueError(f"not an AMD gfx target: {gcn_arch_name!r}")
        return cls(int(digits[:-2]), int(digits[-2], 16), int(digits[-1], 16))


# CDNA before MI300 whose matrix cores take bf16: MI100 (gfx908) and MI200 (gfx90a). Other gfx90x are Vega GPUs.
_CDNA_BF16_BEFORE_MI300 = {GfxArch(9, 0, 0x8), GfxArch(9, 0, 0xA)}


def has_bf16(arch: GfxArch) -> bool:
    """bf16 matrix instructions: CDNA from MI100 on, RDNA3 (gfx11) on. Vega and RDNA1/2 (gfx10) only emulate it."""
    if arch.major == 9:
        return arch.minor >= 4 or arch in _CDNA_BF16_BEFORE_MI300
    return arch.major >= 11


def fp8_dtypes(arch: GfxArch) -> tuple[torch.dtype, torch.dtype] | tuple[None, None]:
    """(e4m3, e5m2) in the encoding the hardware computes in, or (None, None) where it has no fp8."""
    # MI300 (gfx94x) predates the OCP standard: its fp8 has no infinities, one NaN, and an exponent bias one higher.
    if (arch.major, arch.minor) == (9, 4):
        return torch.float8_e4m3fnuz, torch.float8_e5m2fnuz
    # MI350 (gfx950) and RDNA4 (gfx12) switched to the OCP encoding NVIDIA uses.
    if (arch.major == 9 and arch.minor >= 5) or arch.major >= 12:
        return torch.float8_e4m3fn, torch.float8_e5m2
    return None, None
