"""The op table the layers and the sampler call: the platform's fused kernel where it offers one, else the
torch-native reference."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

from omnirun.layers import native_ops
from omnirun.sampling import adjust as sampling_adjust
from omnirun.sampling import reference as sampling_reference
from omnirun.sampling import token_bitmask as sampling_bitmask


@dataclasses.dataclass(frozen=True)
class Ops:
    linear: Callable[..., Any] = native_ops.linear
    prepare_linear: Callable[..., Any] = native_ops.prepare_linear
    rms_norm: Callable[..., Any] = native_ops.rms_norm
    add_rms_norm: Callable[..., Any] = native_ops.add_rms_norm
    silu_and_mul: Callable[..., Any] = native_ops.silu_and_mul
    rotary_embedding: Callable[..., Any] = native_ops.rotary_embedding
    # A mixture of experts: (x [T, H], router logits [T, E], w13 [n, 2I, H], w2 [n, H, I], top_k, renormalize,
    # expert_start) -> [T, H], the routed experts' outputs summed with their weights (w13/w2 hold experts
    # expert_start.. : all of them, or one rank's under expert parallelism).
    fused_moe: Callable[..., Any] = native_ops.fused_moe
    # A mixture of experts that kept its checkpoint's fp8 weights: (x, router logits, w13 float8_e4m3fn [n, 2I, H],
    # w13_scale, w2 float8_e4m3fn [n, H, I], w2_scale, top_k, renormalize, expert_start, block) -> [T, H]; scales
    # float32, one per output row ([n, 2I], [n, H]) or, with `block` (rows, columns), per block ([n, 2I / rows,
    # ceil(H / columns)], [n, ceil(H / rows), ceil(I / columns)]). Offered only where a kernel runs it: with the
    # reference alone, fp8 experts are dequantized at load.
    fp8_fused_moe: Callable[..., Any] = native_ops.fp8_fused_moe
    # A mixture of experts that kept its checkpoint's 4-bit experts (AWQ, GPTQ): (x, router logits, w13_packed int32
    # [n, 2I, H / 8], w13_scale float32 [n, 2I, ceil(H / G)], w13_zero_point uint8 [n, 2I, ceil(H / G)], w2_packed
    # [n, H, I / 8], w2_scale, w2_zero_point [n, H, ceil(I / G)], top_k, renormalize, expert_start, group_size G (-1:
    # one group over each projection's whole input), prepared) -> [T, H]; each expert's rows in int4_linear's
    # layout. Offered only where a kernel runs it: with the reference alone, 4-bit experts are dequantized at load.
    int4_fused_moe: Callable[..., Any] = native_ops.int4_fused_moe
    # The platform's form of kept 4-bit experts: (w13_packed, w13_scale, w13_zero_point, w2_packed, w2_scale,
    # w2_zero_point, group_size) -> Any, passed to `int4_fused_moe` as `prepared` (None: it reads the loaded tensors).
    prepare_int4_fused_moe: Callable[..., Any] = native_ops.prepare_int4_fused_moe
    argmax: Callable[..., Any] = native_ops.argmax  # greedy sampling's pick (the sampler's, not a layer's)
    # A sampled row's pick: (logits [B, V], SamplingBatch) -> int64 [B], filtered by temperature, top-k, top-p and
    # min-p, drawn with the batch's counter-based random numbers.
    sample: Callable[..., Any] = sampling_reference.sample
    # Repetition, frequency and presence penalties before sampling: (logits [B, V], counts [R, V] int32,
    # prompt_seen [R, V] bool or None, rows [B], repetition, frequency, presence [B]) -> float32 [B, V].
    apply_penalties: Callable[..., Any] = sampling_adjust.apply_penalties
    # A grammar's constraint before sampling: (logits [B, V], bitmask int32 [B, ceil(V / 32)]) -> [B, V] with the
    # tokens whose bit is clear at -inf (structured output; omnirun.sampling.token_bitmask).
    apply_token_bitmask: Callable[..., Any] = sampling_bitmask.apply_token_bitmask
    # A linear layer that kept its checkpoint's fp8 weight: (x [M, K], weight float8_e4m3fn [N, K], weight_scale
    # float32 [N] or [ceil(N / rows), ceil(K / columns)], bias or None, block (rows, columns) or None) -> [M, N] in
    # x's dtype. Offered only where a kernel runs it: with the reference alone, fp8 weights are dequantized at load.
    fp8_linear: Callable[..., Any] = native_ops.fp8_linear
    # The platform's form of a kept fp8 weight: (weight, weight_scale, block) -> Any, passed to `fp8_linear` as
    # `prepared` (None: it reads the loaded tensors).
    prepare_fp8_linear: Callable[..., Any] = native_ops.prepare_fp8_linear
    # Which fp8 layers the platform's `fp8_linear` computes itself: (N, K, block, model dtype) -> bool, asked as each
    # layer is built. A layer it declines is dequantized at load (its op would run the reference, which dequantizes
    # the weight at every call).
    fp8_linear_takes: Callable[..., bool] = native_ops.takes_every_layer
    # A linear layer that kept its checkpoint's 4-bit weight (AWQ, GPTQ; W4A16): (x [M, K], weight_packed int32
    # [N, K / 8] (8 inputs a word, lowest bits first), weight_scale float32 [N, groups], weight_zero_point uint8
    # [N, groups], bias or None, group_size) -> [M, N] in x's dtype. Offered only where a kernel runs it: with the
    # reference alone, int4 weights are dequantized at load.
    int4_linear: Callable[..., Any] = native_ops.int4_linear
    # The platform's form of a kept 4-bit weight: (weight_packed, weight_scale, weight_zero_point, group_size) ->
    # Any, passed to `int4_linear` as `prepared`.
    prepare_int4_linear: Callable[..., Any] = native_ops.prepare_int4_linear
    # Which 4-bit layers the platform's `int4_linear` computes itself: (N, K, group_size, model dtype) -> bool.
    int4_linear_takes: Callable[..., bool] = native_ops.takes_every_layer
    # Deterministic mode's linear: each row's result independent of the row count (native_ops has the reference).
    batch_invariant_linear: Callable[..., Any] = native_ops.batch_invariant_linear


OP_NAMES = tuple(field.name for field in dataclasses.fields(Ops))


def runs_fp8_weights(ops: Ops) -> bool:
    """Whether layers keep fp8 checkpoint weights: the platform offers a kernel for them (the reference
    dequantizes the whole weight at every call, so without one the weights are dequantized once, at load)."""
    return ops.fp8_linear is not native_ops.fp8_linear


def runs_fp8_experts(ops: Ops) -> bool:
    """Whether mixtures of experts keep fp8 checkpoint experts: the platform offers a kernel for `fp8_fused_moe`."""
    return ops.fp8_fused_moe is not native_ops.fp8_fused_moe


def runs_int4_experts(ops: Ops) -> bool:
    """Whether mixtures of experts keep AWQ/GPTQ 4-bit experts packed: the platform offers `int4_fused_moe`."""
    return ops.int4_fused_moe is not native_ops.int4_fused_moe


def runs_int4_weights(ops: Ops) -> bool:
    """Whether layers keep AWQ/GPTQ 4-bit weights packed: the platform offers a kernel for `int4_linear`."""
    return ops.int4_linear is not native_ops.int4_linear


def deterministic_ops(ops: Ops) -> Ops:
    """The table deterministic mode runs: linear layers whose rows do not depend on the batch. The platform's own
    `batch_invariant_linear` where it offers one (it reads plain weights), else the reference, which runs the
    platform's linear on fixed-size blocks of rows. Norms, activations, rotary, argmax and sample reduce within a
    row and stay as they are."""
    if ops.batch_invariant_linear is not native_ops.batch_invariant_linear:
        return dataclasses.replace(ops, linear=ops.batch_invariant_linear, prepare_linear=native_ops.prepare_linear)
    blocks = functools.partial(native_ops.batch_invariant_linear, block_linear=ops.linear)
    return dataclasses.replace(ops, linear=blocks)


def resolve_ops(fused: Mapping[str, Callable[..., Any]]) -> Ops:
    """Overlay a platform's fused ops on the references; an op name we do not know is a bug in the platform."""
    unknown = sorted(set(fused) - set(OP_NAMES))
    if unknown:
        raise ValueError(f"platform offers fused ops omnirun does not know: {unknown}; known: {list(OP_NAMES)}")
    if ("linear" in fused) != ("prepare_linear" in fused):
        raise ValueError("a platform offering `linear` must offer `prepare_linear` too (they agree on a format)")
    for op in ("fp8_linear", "int4_linear", "int4_fused_moe"):
        for hook in (f"prepare_{op}", f"{op}_takes"):
            if hook in fused and op not in fused:
                raise ValueError(f"a platform offering `{hook}` must offer `{op}` too (it is about that op)")
    return Ops(**dict(fused))
