"""Dense projections, optionally made of several named output shards (q|k|v, gate|up) fused into one matmul, and
split Megatron-style over a tensor-parallel group: column-parallel (each rank holds a block of the output rows) or
row-parallel (a block of the input columns, the partial products summed over the ranks)."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from omnirun.distributed.tensor_parallel import TensorParallel
from omnirun.layers.ops import Ops
from omnirun.layers.sharding import ShardTarget, Slice, as_slice


class Linear(nn.Module):
    """y = x W^T + b. With `out_features` a mapping {shard: size}, the rows of W are the shards stacked in order, so
    one matmul computes what a checkpoint stores as several projections; `shard_view` addresses each.

    A size given as a `Slice` is this rank's block of a larger checkpoint tensor: out slices make the layer
    column-parallel (its output is this rank's block, no communication); an in slice is for RowParallelLinear."""

    def __init__(
        self,
        in_features: int | Slice,
        out_features: int | Slice | Mapping[str, int | Slice],
        *,
        bias: bool,
        ops: Ops,
        dtype: torch.dtype,
    ):
        super().__init__()
        self.ops = ops
        self.prepared = None  # the platform's form of the weight (see prepare)
        sizes = dict(out_features) if isinstance(out_features, Mapping) else {"": out_features}
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        self.shard_slices: dict[str, Slice] = {}
        offset = 0
        for shard, size in sizes.items():
            part = as_slice(size)
            self.shard_offsets[shard] = (offset, part.size)
            self.shard_slices[shard] = part
            offset += part.size
        self.in_slice = as_slice(in_features)
        if not self.in_slice.is_whole and not all(p.is_whole for p in self.shard_slices.values()):
            raise ValueError("a linear layer splits its input or its output over the ranks, not both")
        self.in_features, self.out_features = self.in_slice.size, offset
        self.weight = nn.Parameter(torch.empty(offset, self.in_features, dtype=dtype), requires_grad=False)
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

    def checkpoint_slice(self, param_name: str, shard: str = "") -> ShardTarget:
        """Where the checkpoint tensor of one shard's `weight` or `bias` lands, and which part of it this rank holds."""
        view = self.shard_view(param_name, shard)
        out = self.shard_slices[shard]
        if param_name == "bias":
            return ShardTarget.of(view, (out.full,), 0, out)  # a row-parallel bias is whole: out is then whole
        full = (out.full, self.in_slice.full)
        if not self.in_slice.is_whole:
            return ShardTarget.of(view, full, 1, self.in_slice)
        return ShardTarget.of(view, full, 0, out)

    def extra_repr(self) -> str:
        shards = ", ".join(f"{name}={size}" for name, (_, size) in self.shard_offsets.items() if name)
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}" + (
            f", shards=({shards})" if shards else ""
        )


class RowParallelLinear(Linear):
    """A block of the input columns per rank; the ranks' partial outputs are summed by an all-reduce. The bias is
    whole on every rank (so every rank loads and updates it alike) but added on the first rank only: the sum must
    hold it once."""

    def __init__(
        self, in_features: Slice, out_features: int, *, bias: bool, ops: Ops, dtype: torch.dtype, tp: TensorParallel
    ):
        super().__init__(in_features, out_features, bias=bias, ops=ops, dtype=dtype)
        self.comm = tp.comm
        self.reduce = tp.size > 1
        self.add_bias = tp.is_first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.reduce:  # one rank: exactly the plain layer
            return self.ops.linear(x, self.weight, self.bias, self.prepared)
        out = self.ops.linear(x, self.weight, self.bias if self.add_bias else None, self.prepared)
        return self.comm.all_reduce(out)
