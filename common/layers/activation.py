"""The gated activation of the MLP."""

from __future__ import annotations

import torch
from torch import nn

from omnirun.layers.ops import Ops


class SiluAndMul(nn.Module):
    """silu(gate) * up for x = [gate | up]: halves the last dimension."""

    def __init__(self, ops: Ops):
        super().__init__()
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.silu_and_mul(x)
