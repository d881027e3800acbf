"""The device's fused ops: here one, silu-and-mul compiled by torch.compile (Inductor's C++ backend on the host).

A vendor returns its own kernels under the op names of `omnirun.layers.ops.OP_NAMES`, with the signatures of the
torch-native references in `omnirun.layers.native_ops`; the conformance suite checks each against its reference.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


def _silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


@functools.cache
def compiled_silu_and_mul():
    # dynamic=True: one compilation serves every number of tokens, instead of one per batch shape.
    return torch.compile(_silu_and_mul, dynamic=True)
