"""How the Triton kernels run and launch, shared by every kernel module: interpreted (Triton's numpy interpreter,
tests on a host without a GPU) or compiled, and the launch option that keeps them bit-exact."""

from __future__ import annotations

import os

import triton
import triton.language as tl


def _interpreted() -> bool:
    knobs = getattr(triton, "knobs", None)  # triton >= 3.4; older ones read the variable directly
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


# Under TRITON_INTERPRET kernels run through numpy, which has no libdevice and truncates float32 -> bfloat16 casts;
# the kernels take a numpy-safe path there and only there.
INTERPRETED = tl.constexpr(_interpreted())

# Torch runs the reference as separate kernels, each rounding its result; letting the compiler fuse a multiply
# and an add into one FMA would skip a rounding and break bit-exactness. Every launch passes this.
BIT_EXACT_LAUNCH = {"enable_fp_fusion": False}
