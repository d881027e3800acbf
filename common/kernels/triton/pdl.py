"""Programmatic dependent launch (PDL, NVIDIA Hopper and later) for the kernels of a forward pass.

A kernel launched with `launch_pdl` may be scheduled while the kernel before it in the stream is still finishing:
its launch overlaps that kernel's tail instead of following its end. Such a kernel must first wait
(`griddepcontrol.wait`: the previous kernel has completed and its writes are visible) before it reads or writes
memory the kernel just before it writes. Having waited, it lets the next kernel be scheduled, so a kernel starts
only once the one before it has passed its wait, that is once the kernel two back has completed: what the kernel
just before does not write (weights; a step's metadata, written before its first kernel) may be read before the
wait. That is how the GEMV gets its first weight block in flight early, the RMS norm its weight, and how the KV
store and decode attention take their positions, slots and request rows off the chain of loads after the wait. A
kernel launched without PDL (cuBLAS, torch's) is serialised as usual, so mixing them is safe, and every wait covers
all earlier kernels by induction.

On an H200, in a CUDA graph of 32 (rmsnorm, 4096 x 4096 GEMV) pairs at one row, a pair took 13.6 us without PDL,
13.0 with it and 11.9 with the GEMV's first weight block loaded before the wait (.gpu probe, triton 3.6).

A platform opts in (`pdl=True` on the launchers: the cuda platform on compute capability 9.0 and later). Elsewhere
USE_PDL is False and the kernels compile as before; Triton's interpreter could not run the instructions.
"""

from __future__ import annotations

import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton build without them: no platform asks it for PDL
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def wait_for_previous_kernel(USE_PDL: tl.constexpr):
    """With PDL: block until the previous kernel's writes are visible, then let the next kernel be scheduled."""
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()


def launch_options(pdl: bool) -> dict[str, bool]:
    """Keyword arguments for a launch (none without PDL: other backends need not know the option)."""
    return {"launch_pdl": True} if pdl else {}
