"""Dense projections, optionally made of several named output shards (q|k|v, gate|up) fused into one matmul, and
split Megatron-style over a tensor-parallel group: column-parallel (each rank holds a block of the output rows) or
row-parallel (a block of the input columns, the partial products summed over the ranks)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn

from omnirun.distributed.tensor_parallel import TensorParallel
from omnirun.layers.ops import Ops
from omnirun.layers.sharding import ShardTarget, Slice, as_slice

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Fp8Weights:
    """A linear layer that keeps its checkpoint's fp8 weight for the op table's `fp8_linear`: the weight in
    float8_e4m3fn [N, K] and `weight_scale` in float32, one per output row ([N]) or, with `block` (rows, columns),
    one per block ([ceil(N / rows), ceil(K / columns)])."""

    block: tuple[int, int] | None = None


# Which linear layers keep fp8 weights: the form a layer made of these checkpoint modules keeps, None for the model
# dtype (a layer fused from q/k/v or gate/up is fp8 only where each of its modules is).
Fp8Of = Callable[[Sequence[str]], "Fp8Weights | None"]


def full_precision(modules: Sequence[str]) -> None:
    """Every layer in the model dtype."""
    return None


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
        fp8: Fp8Weights | None = None,
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
        self.fp8 = fp8 if fp8 is None or self._holds_whole_blocks(fp8) else None  # else dequantized at load
        weight_dtype = dtype if self.fp8 is None else torch.float8_e4m3fn
        self.weight = nn.Parameter(torch.empty(offset, self.in_features, dtype=weight_dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(offset, dtype=dtype), requires_grad=False) if bias else None
        if self.fp8 is not None:
            self.weight_scale = nn.Parameter(torch.empty(self._scale_shape(), dtype=torch.float32), requires_grad=False)

    def _holds_whole_blocks(self, fp8: Fp8Weights) -> bool:
        """Whether each shard, and this rank's rows and columns, are whole blocks of the checkpoint's scales (the
        last block of a dimension may be partial): else no scale belongs to one shard or one rank alone."""
        if fp8.block is None:
            return True
        rows, cols = fp8.block
        parts = [(part, rows) for part in self.shard_slices.values()] + [(self.in_slice, cols)]
        parts += [(Slice(self.out_features, offset, size), rows) for offset, size in self.shard_offsets.values()]
        cut = [part for part, step in parts if part.start % step or (part.size % step and part.end != part.full)]
        if cut:
            logger.info("fp8 blocks %s cut at %s: this layer is dequantized at load", list(fp8.block), cut[0])
        return not cut

    def _scale_shape(self) -> tuple[int, ...]:
        """[N], or one scale per block."""
        if self.fp8.block is None:
            return (self.out_features,)
        rows, cols = self.fp8.block
        return (-(-self.out_features // rows), -(-self.in_features // cols))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x, self.bias)

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.fp8 is not None:
            return self.ops.fp8_linear(x, self.weight, self.weight_scale, bias, self.fp8.block)
        return self.ops.linear(x, self.weight, bias, self.prepared)

    def prepare(self) -> None:
        """Let the platform re-lay the weight for its kernels; called after loading and after weight updates."""
        if self.fp8 is None:  # fp8_linear reads the checkpoint's layout
            self.prepared = self.ops.prepare_linear(self.weight)

    def shard_view(self, param_name: str, shard: str = "") -> torch.Tensor:
        """The rows of `weight`, `bias` or `weight_scale` that hold one shard (all of it for an unsharded layer)."""
        offset, size = self.shard_offsets[shard]
        if param_name == "weight_scale" and self.fp8.block is not None:  # rows of blocks
            offset, size = offset // self.fp8.block[0], -(-size // self.fp8.block[0])
        return getattr(self, param_name).data.narrow(0, offset, size)

    def checkpoint_slice(self, param_name: str, shard: str = "") -> ShardTarget:
        """Where the checkpoint tensor of one shard's `weight`, `bias` or `weight_scale` lands, and which part of it
        this rank holds."""
        view = self.shard_view(param_name, shard)
        out = self.shard_slices[shard]
        if param_name == "bias" or (param_name == "weight_scale" and self.fp8.block is None):
            return ShardTarget.of(view, (out.full,), 0, out)  # whole in a row-parallel layer: out is then whole
        inputs = self.in_slice
        if param_name == "weight_scale":  # the same split, counted in blocks
            rows, cols = self.fp8.block
            out = Slice(-(-out.full // rows), out.start // rows, -(-out.size // rows))
            inputs = Slice(-(-inputs.full // cols), inputs.start // cols, -(-inputs.size // cols))
        full = (out.full, inputs.full)
        if not inputs.is_whole:
            return ShardTarget.of(view, full, 1, inputs)
        return ShardTarget.of(view, full, 0, out)

    def extra_repr(self) -> str:
        shards = ", ".join(f"{name}={size}" for name, (_, size) in self.shard_offsets.items() if name)
        fp8 = "" if self.fp8 is None else f", fp8={'per-row' if self.fp8.block is None else list(self.fp8.block)}"
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}{fp8}" + (
            f", shards=({shards})" if shards else ""
        )


class RowParallelLinear(Linear):
    """A block of the input columns per rank; the ranks' partial outputs are summed by an all-reduce. The bias is
    whole on every rank (so every rank loads and updates it alike) but added on the first rank only: the sum must
    hold it once."""

    def __init__(
        self,
        in_features: Slice,
        out_features: int,
        *,
        bias: bool,
        ops: Ops,
        dtype: torch.dtype,
        tp: TensorParallel,
        fp8: Fp8Weights | None = None,
    ):
        super().__init__(in_features, out_features, bias=bias, ops=ops, dtype=dtype, fp8=fp8)
        self.comm = tp.comm
        self.reduce = tp.size > 1
        self.add_bias = tp.is_first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.reduce:  # one rank: exactly the plain layer
            return self._matmul(x, self.bias)
        return self.comm.all_reduce(self._matmul(x, self.bias if self.add_bias else None))
