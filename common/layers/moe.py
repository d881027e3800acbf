"""A mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE): a router picks each token's top-k experts, the op
table's `fused_moe` runs them, and Qwen2-MoE adds a shared expert gated by a sigmoid.

The experts' weights are stacked: `w13` [E, 2I, H] holds each expert's gate and up rows (the checkpoint's
`gate_proj`/`up_proj`, Mixtral's `w1`/`w3`), `w2` [E, H, I] its down projection (`down_proj`, `w2`). Under tensor
parallelism every rank holds every expert's block of I columns; with expert parallelism it holds a block of whole
experts instead, and computes only the slots routed to them. Either way the ranks' partial outputs are summed by an
all-reduce, as the dense MLP's are (the router and the tokens are the same on every rank).

Experts a checkpoint stores in fp8 stay in fp8 where the platform runs `fp8_fused_moe` (and gate's rows fill whole
blocks of rows, so that up's start a block): `w13`/`w2` then hold the fp8 values and `w13_scale`/`w2_scale` the
float32 scales, per output row or per block, stacked as the weights are. AWQ/GPTQ 4-bit experts stay packed where
the platform runs `int4_fused_moe` (and the down projection's inputs on this rank are whole words): `w13_packed`,
`w13_scale`, `w13_zero_point` and `w2_*` hold each expert's rows in int4_linear's layout (Int4Weights), stacked. A
rank whose columns cut the down projection's groups (int4) or the blocks (fp8) widens them to whole ones with columns
of zeros (`lead`; _int4_span, _fp8_span), as the kernels read a scale from a group's or block's first column on.
Elsewhere they are dequantized at load.
"""

from __future__ import annotations

import functools
import logging
import math

import torch
from torch import nn

from omnirun.distributed.tensor_parallel import TensorParallel
from omnirun.layers.linear import Fp8Weights, Int4Weights, KeptWeightMismatch, Linear, QuantizedWeights
from omnirun.layers.ops import Ops, runs_fp8_experts, runs_int4_experts
from omnirun.layers.prepared import made_form
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
        """`quantized`: the form the checkpoint stores the experts in (kept where `_keeps_fp8` / `_keeps_int4` say
        so)."""
        super().__init__()
        self.ops, self.top_k, self.renormalize, self.columns = ops, top_k, renormalize, columns
        self.num_experts, self.experts = num_experts, experts  # all of them, and the global ids of this rank's
        self.gate = Linear(hidden_size, num_experts, bias=False, ops=ops, dtype=dtype)  # the router, whole
        size, local = columns.size, len(experts)
        self.fp8 = quantized if isinstance(quantized, Fp8Weights) and self._keeps_fp8(quantized, ops) else None
        self.int4 = quantized if isinstance(quantized, Int4Weights) and self._keeps_int4(quantized, ops) else None
        self.hidden_size = hidden_size
        if self.int4 is not None:
            # this rank's columns widened to whole groups of the down projection's inputs (see _int4_span); the
            # columns it does not own stay zeros: gate and up rows of weight 0, so their activations are 0
            self.lead, padded = self._int4_span()
            for name, rows, inputs in (("w13", 2 * padded, hidden_size), ("w2", hidden_size, padded)):
                groups = -(-inputs // self._group(inputs))
                setattr(self, f"{name}_packed", _frozen(torch.zeros(local, rows, inputs // 8, dtype=torch.int32)))
                setattr(self, f"{name}_scale", _frozen(torch.zeros(local, rows, groups)))
                setattr(self, f"{name}_zero_point", _frozen(torch.zeros(local, rows, groups, dtype=torch.uint8)))
        elif self.fp8 is not None:
            # as int4's: this rank's columns widened to whole blocks, the columns it does not own zeros (_fp8_span)
            self.lead, padded = self._fp8_span()
            self.w13 = _frozen(torch.zeros(local, 2 * padded, hidden_size, dtype=torch.float8_e4m3fn))
            self.w2 = _frozen(torch.zeros(local, hidden_size, padded, dtype=torch.float8_e4m3fn))
            self.w13_scale = _frozen(torch.zeros(local, *self._scale_shape(2 * padded, hidden_size)))
            self.w2_scale = _frozen(torch.zeros(local, *self._scale_shape(hidden_size, padded)))
        else:
            self.lead = 0
            self.w13 = _frozen(torch.empty(local, 2 * size, hidden_size, dtype=dtype))
            self.w2 = _frozen(torch.empty(local, hidden_size, size, dtype=dtype))
        self.prepared = None  # the platform's form of kept 4-bit experts (see prepare)
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
        _, padded = _widened(part, math.lcm(rows, cols))
        if padded % rows:  # gate's last block of rows would hold up's first rows in the stacked w13
            _say_once(f"fp8 blocks {list(fp8.block)} cut at expert columns {part}: the experts are dequantized at load")
            return False
        return True

    def _fp8_span(self) -> tuple[int, int]:
        """(lead, padded) as _int4_span's, in whole blocks of rows and of columns (their least common multiple;
        per-row scales: this rank's columns as they are): Qwen3-235B-A22B-FP8 at TP 8 holds 192 of 1,536 columns a
        rank, blocks of 128 x 128."""
        if self.fp8.block is None:
            return 0, self.columns.size
        return self._span(math.lcm(*self.fp8.block), "fp8 blocks")

    def _keeps_int4(self, int4: Int4Weights, ops: Ops) -> bool:
        """Whether the experts stay packed: the platform runs `int4_fused_moe`, and this rank's inputs of the down
        projection are whole words of eight, and whole groups unless groups of a set size (a rank's columns that cut
        such groups are widened to whole ones, see _int4_span; one group over all the inputs is not widened)."""
        if not runs_int4_experts(ops):
            _say_once("this device runs no int4_fused_moe kernel: 4-bit experts are dequantized at load")
            return False
        part = self.columns
        cut = part.start % 8 or part.size % 8
        if int4.group_size == -1:
            cut = cut or not part.is_whole
        if cut:
            what = f"its one int4 group of {part.full}" if int4.group_size == -1 else "int4 words of eight inputs"
            _say_once(f"expert columns {part} cut {what}: the experts are dequantized at load")
        return not cut

    def _int4_span(self) -> tuple[int, int]:
        """(lead, padded): this rank's columns widened to whole groups of the down projection's inputs, as the
        kernels read scales from the first input of a group: `lead` columns before its first (the rest of the group
        it starts in) and `padded` in all (to the end of the group it ends in, or of the projection). Whole groups
        already: (0, its columns). Qwen3-235B-A22B-AWQ at TP 8 holds 192 of 1,536 columns a rank, groups of 128:
        rank 1 reads inputs 128-383, its own 192-383."""
        if self.int4.group_size == -1:
            return 0, self.columns.size
        return self._span(self.int4.group_size, "int4 groups")

    def _span(self, unit: int, what: str) -> tuple[int, int]:
        """This rank's columns widened to whole units of `unit` columns (_widened), said once where widened."""
        part = self.columns
        lead, padded = _widened(part, unit)
        if padded != part.size:
            _say_once(f"expert columns {part} cut {what} of {unit}: widened to {padded} columns (the rest zeros)")
        return lead, padded

    def _group(self, inputs: int) -> int:
        """The kept 4-bit experts' inputs per scale for a projection of `inputs` inputs (group size -1: all of them,
        whole on this rank where kept)."""
        return inputs if self.int4.group_size == -1 else self.int4.group_size

    def _scale_shape(self, rows: int, cols: int) -> tuple[int, ...]:
        if self.fp8.block is None:
            return (rows,)
        return (-(-rows // self.fp8.block[0]), -(-cols // self.fp8.block[1]))

    def prepare(self) -> None:
        """Hand kept 4-bit experts to the platform's `prepare_int4_fused_moe` (after loading and after each weight
        update, as Linear.prepare does); what it makes is passed to `int4_fused_moe`."""
        if self.int4 is not None:
            self.prepared = made_form(
                self,
                ("w13_packed", "w13_scale", "w13_zero_point", "w2_packed", "w2_scale", "w2_zero_point"),
                lambda *loaded: self.ops.prepare_int4_fused_moe(*loaded, self.int4.group_size),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)
        if self.int4 is not None:
            out = self.ops.int4_fused_moe(
                x, logits, self.w13_packed, self.w13_scale, self.w13_zero_point, self.w2_packed, self.w2_scale,
                self.w2_zero_point, self.top_k, self.renormalize, self.experts.start, self.int4.group_size,
                self.prepared,
            )  # fmt: skip
        elif self.fp8 is not None:
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
        lives on another rank): its `weight`, the `weight_scale` of experts kept in fp8, or the `weight_packed`,
        `weight_scale` and `weight_zero_point` of experts kept in int4 (KeyError otherwise)."""
        if self.int4 is not None:
            return self._int4_target(expert, projection, param)
        if param not in ("weight", "weight_scale") or (param == "weight_scale" and self.fp8 is None):
            raise KeyError(param)
        if expert not in self.experts:
            return None
        expert -= self.experts.start
        hidden, columns, lead, padded = self.w2.shape[1], self.columns, self.lead, self.w2.shape[2]
        scale = param == "weight_scale"
        if projection == "down":
            full = (hidden, columns.full)
            if scale and self.fp8.block is None:  # one per output row: the rows are whole on every rank
                return ShardTarget.of(self.w2_scale.data[expert], (hidden,), 0, Slice.whole(hidden))
            if scale:  # the blocks this rank's (widened) inputs lie in, whole
                full, columns = self._in_blocks(full, Slice(columns.full, columns.start - lead, padded), axis=1)
                return ShardTarget.of(self.w2_scale.data[expert], full, 1, columns)
            return ShardTarget.of(self.w2.data[expert].narrow(1, lead, columns.size), full, 1, columns)
        full = (columns.full, hidden)
        if scale and self.fp8.block is None:
            full = (columns.full,)
        elif scale:  # the blocks of rows this rank's (widened) columns lie in, whole
            full, columns = self._in_blocks(full, Slice(columns.full, columns.start - lead, padded), axis=0)
            blocks = columns.size
            return ShardTarget.of(self.w13_scale.data[expert].narrow(0, 0 if projection == "gate" else blocks, blocks),
                                  full, 0, columns)  # fmt: skip
        stacked = (self.w13_scale if scale else self.w13).data[expert]
        rows = stacked.narrow(0, lead if projection == "gate" else padded + lead, columns.size)
        return ShardTarget.of(rows, full, 0, columns)

    def _int4_target(self, expert: int, projection: str, param: str) -> ShardTarget | None:
        """`expert_target` of experts kept packed: `weight_packed` (words of eight inputs), `weight_scale` and
        `weight_zero_point` (a column per group), each expert's rows stacked as `w13`/`w2`'s are."""
        parts = ("weight_packed", "weight_scale", "weight_zero_point")
        if expert not in self.experts and param in ("weight", *parts):  # another rank's: its parts are dropped unread
            return None
        if param == "weight":
            raise KeptWeightMismatch("its experts keep the int4 weights the checkpoint's quantization_config says")
        if param not in parts:
            raise KeyError(param)
        name = "w2" if projection == "down" else "w13"
        stacked = getattr(self, f"{name}_{param.removeprefix('weight_')}").data[expert - self.experts.start]
        columns, lead, padded = self.columns, self.lead, self.w2_packed.shape[2] * 8
        if projection == "down" and param == "weight_packed":  # this rank's inputs, whole words, after `lead`
            part = Slice(columns.full // 8, columns.start // 8, columns.size // 8)
            return ShardTarget.of(stacked.narrow(1, lead // 8, part.size), (self.hidden_size, part.full), 1, part)
        if projection == "down":  # the groups this rank's (widened) inputs lie in, whole
            step = self._group(columns.full)
            part = Slice(-(-columns.full // step), (columns.start - lead) // step, stacked.shape[1])
            return ShardTarget.of(stacked, (self.hidden_size, part.full), 1, part)
        inputs = self.hidden_size // 8 if param == "weight_packed" else stacked.shape[1]
        rows = stacked.narrow(0, lead if projection == "gate" else padded + lead, columns.size)
        return ShardTarget.of(rows, (columns.full, inputs), 0, columns)

    def _in_blocks(self, full: tuple[int, int], part: Slice, axis: int) -> tuple[tuple[int, int], Slice]:
        """A projection's full shape and this rank's part along `axis`, counted in the fp8 scales' blocks."""
        blocks = tuple(-(-size // step) for size, step in zip(full, self.fp8.block, strict=True))
        step = self.fp8.block[axis]
        return blocks, Slice(blocks[axis], part.start // step, -(-part.size // step))

    def weights(self) -> tuple[nn.Parameter, ...]:
        """Every tensor the experts are made of (the fp8 scales, the 4-bit scales and zero points too)."""
        if self.int4 is not None:
            parts = ("packed", "scale", "zero_point")
            return tuple(getattr(self, f"{name}_{part}") for name in ("w13", "w2") for part in parts)
        return (self.w13, self.w2) + ((self.w13_scale, self.w2_scale) if self.fp8 is not None else ())

    def checkpoint_params(self) -> tuple[str, ...]:
        """The parameters of each expert projection a checkpoint of this layer holds (its `expert_target`s)."""
        if self.int4 is not None:
            return ("weight_packed", "weight_scale", "weight_zero_point")
        return ("weight", "weight_scale") if self.fp8 is not None else ("weight",)

    def extra_repr(self) -> str:
        kept = "" if self.fp8 is None else f", fp8={'per-row' if self.fp8.block is None else list(self.fp8.block)}"
        kept += "" if self.int4 is None else f", int4 group {self.int4.group_size}"
        return f"experts={self.experts.start}..{self.experts.stop - 1} of {self.num_experts}, top_k={self.top_k}{kept}"


@functools.cache
def _widened(part: Slice, unit: int) -> tuple[int, int]:
    """`part` widened to whole units of `unit` columns (the last may end at the projection's end): (columns before its
    first, columns in all)."""
    lead = part.start % unit
    return lead, min(-(-part.end // unit) * unit, part.full) - (part.start - lead)


def _say_once(line: str) -> None:
    """One log line however many layers say it."""
    logger.info(line)


def _frozen(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)
