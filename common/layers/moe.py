"""A mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE): a router picks each token's top-k experts, the op
table's `fused_moe` runs them, and Qwen2-MoE adds a shared expert gated by a sigmoid.

The experts' weights are stacked: `w13` [E, 2I, H] holds each expert's gate and up rows (the checkpoint's
`gate_proj`/`up_proj`, Mixtral's `w1`/`w3`), `w2` [E, H, I] its down projection (`down_proj`, `w2`). Under tensor
parallelism every rank holds every expert's block of I columns; with expert parallelism it holds a block of whole
experts instead, and computes only the slots routed to them. Either way the ranks' partial outputs are summed by an
all-reduce, as the dense MLP's are (the router and the tokens are the same on every rank).

Experts a checkpoint stores in fp8 stay in fp8 where the platform runs `fp8_fused_moe` (and the split keeps each
scale with one expert projection and one rank): `w13`/`w2` then hold the fp8 values and `w13_scale`/`w2_scale` the
float32 scales, per output row or per block, stacked as the weights are. Elsewhere they are dequantized at load.
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import nn

from omnirun.distributed.tensor_parallel import TensorParallel
from omnirun.layers.linear import Fp8Weights, Linear, QuantizedWeights
from omnirun.layers.ops import Ops, runs_fp8_experts
from omnirun.layers.sharding import ShardTarget, Slice

logger = logging.getLogger(__name__)


class SparseMoE(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        experts: range,
        top_k: int,
        renormalize: bool,
        columns: Slice,
        *,
        ops: Ops,
        dtype: torch.dtype,
        tp: TensorParallel,
        shared: nn.Module | None = None,
        quantized: QuantizedWeights | None = None,
    ):
        """`quantized`: the form the checkpoint stores the experts in (kept where `_keeps_fp8` says so)."""
        super().__init__()
        self.ops, self.top_k, self.renormalize, self.columns = ops, top_k, renormalize, columns
        self.num_experts, self.experts = num_experts, experts  # all of them, and the global ids of this rank's
        self.gate = Linear(hidden_size, num_experts, bias=False, ops=ops, dtype=dtype)  # the router, whole
        size, local = columns.size, len(experts)
        self.fp8 = quantized if isinstance(quantized, Fp8Weights) and self._keeps_fp8(quantized, ops) else None
        weight_dtype = dtype if self.fp8 is None else torch.float8_e4m3fn
        self.w13 = _frozen(torch.empty(local, 2 * size, hidden_size, dtype=weight_dtype))
        self.w2 = _frozen(torch.empty(local, hidden_size, size, dtype=weight_dtype))
        if self.fp8 is not None:
            self.w13_scale = _frozen(torch.empty(local, *self._scale_shape(2 * size, hidden_size)))
            self.w2_scale = _frozen(torch.empty(local, *self._scale_shape(hidden_size, size)))
        self.comm, self.reduce = tp.comm, tp.size > 1
        self.shared_expert = shared  # an MLP whose down projection does its own all-reduce
        self.shared_expert_gate = Linear(hidden_size, 1, bias=False, ops=ops, dtype=dtype) if shared else None

    def _keeps_fp8(self, fp8: Fp8Weights, ops: Ops) -> bool:
        """Whether the experts stay in fp8: the platform runs `fp8_fused_moe`, and with blocks, this rank's columns
        of each projection are whole blocks (gate's and up's rows stacked block by block, the down projection's
        inputs cut at block edges; the last block of the checkpoint's may be partial)."""
        if not runs_fp8_experts(ops):
            _say_once("this device runs no fp8_fused_moe kernel: fp8 experts are dequantized at load")
            return False
        if fp8.block is None:
            return True
        rows, cols = fp8.block
        part = self.columns
        cut = part.size % rows or part.start % rows or part.start % cols or (part.size % cols and part.end != part.full)
        if cut:
            _say_once(f"fp8 blocks {list(fp8.block)} cut at expert columns {part}: the experts are dequantized at load")
        return not cut

    def _scale_shape(self, rows: int, cols: int) -> tuple[int, ...]:
        if self.fp8.block is None:
            return (rows,)
        return (-(-rows // self.fp8.block[0]), -(-cols // self.fp8.block[1]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)
        if self.fp8 is not None:
            out = self.ops.fp8_fused_moe(
                x, logits, self.w13, self.w13_scale, self.w2, self.w2_scale, self.top_k, self.renormalize,
                self.experts.start, self.fp8.block,
            )  # fmt: skip
        else:
            out = self.ops.fused_moe(x, logits, self.w13, self.w2, self.top_k, self.renormalize, self.experts.start)
        if self.reduce:
            out = self.comm.all_reduce(out)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    def expert_target(self, expert: int, projection: str, param: str = "weight") -> ShardTarget | None:
        """Where one expert's checkpoint projection ("gate", "up" or "down") lands on this rank (None: the expert
        lives on another rank): its `weight`, or the `weight_scale` of experts kept in fp8 (KeyError otherwise)."""
        if param not in ("weight", "weight_scale") or (param == "weight_scale" and self.fp8 is None):
            raise KeyError(param)
        if expert not in self.experts:
            return None
        expert -= self.experts.start
        hidden, columns = self.w2.shape[1], self.columns
        scale = param == "weight_scale"
        if projection == "down":
            full = (hidden, columns.full)
            if scale and self.fp8.block is None:  # one per output row: the rows are whole on every rank
                return ShardTarget.of(self.w2_scale.data[expert], (hidden,), 0, Slice.whole(hidden))
            if scale:
                full, columns = self._in_blocks(full, columns, axis=1)
            view = (self.w2_scale if scale else self.w2).data[expert]
            return ShardTarget.of(view, full, 1, columns)
        full = (columns.full, hidden)
        if scale and self.fp8.block is None:
            full = (columns.full,)
        elif scale:
            full, columns = self._in_blocks(full, columns, axis=0)
        stacked = (self.w13_scale if scale else self.w13).data[expert]
        rows = stacked.narrow(0, 0 if projection == "gate" else columns.size, columns.size)
        return ShardTarget.of(rows, full, 0, columns)

    def _in_blocks(self, full: tuple[int, int], part: Slice, axis: int) -> tuple[tuple[int, int], Slice]:
        """A projection's full shape and this rank's part along `axis`, counted in the fp8 scales' blocks."""
        blocks = tuple(-(-size // step) for size, step in zip(full, self.fp8.block, strict=True))
        step = self.fp8.block[axis]
        return blocks, Slice(blocks[axis], part.start // step, -(-part.size // step))

    def weights(self) -> tuple[nn.Parameter, ...]:
        """Every tensor the experts are made of (the fp8 scales too)."""
        return (self.w13, self.w2) + ((self.w13_scale, self.w2_scale) if self.fp8 is not None else ())

    def extra_repr(self) -> str:
        kept = "" if self.fp8 is None else f", fp8={'per-row' if self.fp8.block is None else list(self.fp8.block)}"
        return f"experts={self.experts.start}..{self.experts.stop - 1} of {self.num_experts}, top_k={self.top_k}{kept}"


@functools.cache
def _say_once(line: str) -> None:
    """One log line however many layers say it."""
    logger.info(line)


def _frozen(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)
