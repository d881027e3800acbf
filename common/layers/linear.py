"""Dense projections, optionally made of several named output shards (q|k|v, gate|up) fused into one matmul, and
split Megatron-style over a tensor-parallel group: column-parallel (each rank holds a block of the output rows) or
row-parallel (a block of the input columns, the partial products summed over the ranks)."""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from omnirun.distributed.tensor_parallel import TensorParallel
from omnirun.layers.ops import Ops
from omnirun.layers.prepared import made_form
from omnirun.layers.sharding import ShardTarget, Slice, as_slice

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Fp8Weights:
    """A linear layer that keeps its checkpoint's fp8 weight for the op table's `fp8_linear`: the weight in
    float8_e4m3fn [N, K] and `weight_scale` in float32, one per output row ([N]) or, with `block` (rows, columns),
    one per block ([ceil(N / rows), ceil(K / columns)])."""

    block: tuple[int, int] | None = None


@dataclasses.dataclass(frozen=True)
class Int4Weights:
    """A linear layer that keeps its checkpoint's 4-bit weight (AWQ, GPTQ) for the op table's `int4_linear`, in one
    layout whatever the checkpoint's: `weight_packed` int32 [N, K / 8] (eight consecutive inputs a word, the lowest
    bits first), `weight_scale` float32 and `weight_zero_point` uint8, both [N, groups] (groups of `group_size`
    consecutive inputs; -1: one group over the whole input). Every tensor has a row per output: column-parallel
    splits and fused shards cut rows alone; a row-parallel split must fall on whole groups (else that layer is
    dequantized at load)."""

    group_size: int


QuantizedWeights = Fp8Weights | Int4Weights

# Which linear layers keep quantized weights: the form a layer made of these checkpoint modules keeps, None for the
# model dtype (a layer fused from q/k/v or gate/up is quantized only where each of its modules is).
QuantizedOf = Callable[[Sequence[str]], "QuantizedWeights | None"]


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
        quantized: QuantizedWeights | None = None,
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
        # Kept quantized where the split allows it, else dequantized at load.
        fp8 = quantized if isinstance(quantized, Fp8Weights) else None
        fp8_taken = fp8 is not None and self._taken("fp8_linear", ops.fp8_linear_takes, fp8.block, dtype)
        self.fp8 = fp8 if fp8_taken and self._holds_whole_blocks(fp8) else None
        int4 = quantized if isinstance(quantized, Int4Weights) else None
        group = None if int4 is None else self.in_slice.full if int4.group_size == -1 else int4.group_size
        int4_taken = int4 is not None and self._taken("int4_linear", ops.int4_linear_takes, group, dtype)
        self.int4 = int4 if int4_taken and self._holds_whole_groups(int4) else None
        self.bias = nn.Parameter(torch.empty(offset, dtype=dtype), requires_grad=False) if bias else None
        if self.int4 is not None:
            groups = -(-self.in_features // self.group_size)
            self.weight_packed = _frozen(torch.empty(offset, self.in_features // 8, dtype=torch.int32))
            self.weight_scale = _frozen(torch.empty(offset, groups, dtype=torch.float32))
            self.weight_zero_point = _frozen(torch.empty(offset, groups, dtype=torch.uint8))
            return
        weight_dtype = dtype if self.fp8 is None else torch.float8_e4m3fn
        self.weight = _frozen(torch.empty(offset, self.in_features, dtype=weight_dtype))
        if self.fp8 is not None:
            self.weight_scale = _frozen(torch.empty(self._scale_shape(), dtype=torch.float32))

    @property
    def group_size(self) -> int:
        """An int4 layer's inputs per scale (a group over the whole input counted as the checkpoint's whole K)."""
        return self.in_slice.full if self.int4.group_size == -1 else self.int4.group_size

    def _taken(self, op: str, takes: Callable[..., bool], layout: Any, dtype: torch.dtype) -> bool:
        """Whether the platform's quantized op computes this layer itself (`Ops.fp8_linear_takes`)."""
        if takes(self.out_features, self.in_features, layout, dtype):
            return True
        _say_dequantized(op, self.out_features, self.in_features, layout, str(dtype).removeprefix("torch."))
        return False

    def _holds_whole_groups(self, int4: Int4Weights) -> bool:
        """Whether this rank's inputs are whole groups of the checkpoint's scales (the last one may be partial) and
        whole words of eight: else its scales or words are shared with another rank."""
        part = self.in_slice
        size = part.full if int4.group_size == -1 else int4.group_size
        cut = part.start % size or (part.size % size and part.end != part.full) or part.size % 8 or part.start % 8
        if cut:
            logger.info("int4 groups of %d cut at %s: this layer is dequantized at load", size, part)
        return not cut

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
        if self.int4 is not None:
            return self.ops.int4_linear(
                x, self.weight_packed, self.weight_scale, self.weight_zero_point, bias, self.group_size, self.prepared
            )
        if self.fp8 is not None:
            return self.ops.fp8_linear(x, self.weight, self.weight_scale, bias, self.fp8.block, self.prepared)
        return self.ops.linear(x, self.weight, bias, self.prepared)

    def prepare(self) -> None:
        """Let the platform re-lay the weight for its kernels; called after loading and after weight updates."""
        if self.int4 is not None:
            self.prepared = made_form(
                self,
                ("weight_packed", "weight_scale", "weight_zero_point"),
                lambda *loaded: self.ops.prepare_int4_linear(*loaded, self.group_size),
            )
        elif self.fp8 is not None:
            self.prepared = made_form(
                self, ("weight", "weight_scale"), lambda *loaded: self.ops.prepare_fp8_linear(*loaded, self.fp8.block)
            )
        else:
            self.prepared = self.ops.prepare_linear(self.weight)

    def shard_view(self, param_name: str, shard: str = "") -> torch.Tensor:
        """The rows of a parameter (`weight`, `bias`, and a quantized layer's scales and zero points) that hold one
        shard (all of it for an unsharded layer)."""
        offset, size = self.shard_offsets[shard]
        if param_name == "weight_scale" and self.fp8 is not None and self.fp8.block is not None:  # rows of blocks
            offset, size = offset // self.fp8.block[0], -(-size // self.fp8.block[0])
        return getattr(self, param_name).data.narrow(0, offset, size)

    def checkpoint_slice(self, param_name: str, shard: str = "") -> ShardTarget:
        """Where the checkpoint tensor of one shard's parameter lands, and which part of it this rank holds; KeyError
        for a parameter this layer does not have."""
        if param_name == "weight" and self.int4 is not None:
            raise KeptWeightMismatch(
                "its layer keeps the int4 weights the checkpoint's quantization_config says it has"
            )
        if not isinstance(getattr(self, param_name, None), nn.Parameter):
            raise KeyError(param_name)
        view = self.shard_view(param_name, shard)
        out = self.shard_slices[shard]
        if param_name == "bias" or (param_name == "weight_scale" and self.fp8 is not None and self.fp8.block is None):
            return ShardTarget.of(view, (out.full,), 0, out)  # whole in a row-parallel layer: out is then whole
        inputs = self.in_slice
        if param_name == "weight_scale" and self.fp8 is not None:  # the same split, counted in blocks
            rows, cols = self.fp8.block
            out = Slice(-(-out.full // rows), out.start // rows, -(-out.size // rows))
            inputs = Slice(-(-inputs.full // cols), inputs.start // cols, -(-inputs.size // cols))
        elif param_name == "weight_packed":  # counted in words of eight inputs
            inputs = Slice(inputs.full // 8, inputs.start // 8, inputs.size // 8)
        elif param_name in ("weight_scale", "weight_zero_point"):  # int4: counted in groups
            size = self.group_size
            inputs = Slice(-(-inputs.full // size), inputs.start // size, -(-inputs.size // size))
        full = (out.full, inputs.full)
        if not inputs.is_whole:
            return ShardTarget.of(view, full, 1, inputs)
        return ShardTarget.of(view, full, 0, out)

    def extra_repr(self) -> str:
        shards = ", ".join(f"{name}={size}" for name, (_, size) in self.shard_offsets.items() if name)
        kept = "" if self.fp8 is None else f", fp8={'per-row' if self.fp8.block is None else list(self.fp8.block)}"
        kept += "" if self.int4 is None else f", int4=group {self.group_size}"
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}{kept}" + (
            f", shards=({shards})" if shards else ""
        )


def _frozen(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)


class KeptWeightMismatch(ValueError):
    """A checkpoint tensor in full precision for a layer that keeps quantized weights."""

    hint = "name its module in the config's modules_to_not_convert (awq, gptq) or dynamic '-:' rules (gptq)"


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
        quantized: QuantizedWeights | None = None,
    ):
        super().__init__(in_features, out_features, bias=bias, ops=ops, dtype=dtype, quantized=quantized)
        self.comm = tp.comm
        self.reduce = tp.size > 1
        self.add_bias = tp.is_first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.reduce:  # one rank: exactly the plain layer
            return self._matmul(x, self.bias)
        return self.comm.all_reduce(self._matmul(x, self.bias if self.add_bias else None))


@functools.cache
def _say_dequantized(op: str, out_features: int, in_features: int, layout: Any, dtype: str) -> None:
    """One line per kind of layer a quantized op declines (a model has dozens of each)."""
    logger.info(
        "%s does not take %d x %d layers (%s, %s) on this device: they are dequantized at load",
        op,
        out_features,
        in_features,
        layout,
        dtype,
    )
