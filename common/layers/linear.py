"""Dense projections, optionally made of several named output shards (q|k|v, gate|up) fused into one matmul."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from omnirun.layers.ops import Ops


class Linear(nn.Module):
    """y = x W^T + b. With `out_features` a mapping {shard: size}, the rows of W are the shards stacked in order, so
    one matmul computes what a checkpoint stores as several projections; `shard_view` addresses each."""

    def __init__(
        self, in_features: int, out_features: int | Mapping[str, int], *, bias: bool, ops: Ops, dtype: torch.dtype
    ):
        super().__init__()
        self.ops = ops
        self.prepared = None  # the platform's form of the weight (see prepare)
        sizes = {"": out_features} if isinstance(out_features, int) else dict(out_features)
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        for shard, size in sizes.items():
            self.shard_offsets[shard] = (offset, size)
            offset += size
        self.in_features, self.out_features = in_features, offset
        self.weight = nn.Parameter(torch.empty(offset, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(offset, dtype=dtype), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(x, self.weight, self.bias, self.prepared)

    def prepare(self) -> None:
        """Let the platform re-lay the weight for its kernels; called after loading and after weight updates."""
        self.prepared = self.ops.prepare_linear(self.weight)

    def shard_view(self, param_name: str, shard: str = "") -> torch.Tensor:
        """The rows of `weight` or `bias` that hold one shard (all of it for an unsharded layer)."""
        offset, size = self.shard_offsets[shard]
        return getattr(self, param_name).data.narrow(0, offset, size)

    def extra_repr(self) -> str:
        shards = ", ".join(f"{name}={size}" for name, (_, size) in self.shard_offsets.items() if name)
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}" + (
            f", shards=({shards})" if shards else ""
        )
