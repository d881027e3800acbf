"""RMSNorm, with the residual add of the block before it fused in when a residual is passed."""

from __future__ import annotations

import torch
from torch import nn

from omnirun.layers.ops import Ops


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, *, ops: Ops, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=dtype), requires_grad=False)
        self.eps = eps
        self.ops = ops

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """rms_norm(x), or (rms_norm(x + residual), x + residual) when a residual is given."""
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.numel()}, eps={self.eps}"
