"""Torch-native reference implementations of the ops a platform may replace with fused kernels.

They follow HF transformers' Llama code op for op (same dtypes at each step), so that a model built on them
matches HF to the last bit in bf16, and every fused kernel is checked against them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, prepared: Any = None) -> torch.Tensor:
    """x W^T + b. `prepared` is what the platform's `prepare_linear` made of the weight (unused here)."""
    return F.linear(x, weight, bias)


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    block: tuple[int, int] | None,
    prepared: Any = None,
) -> torch.Tensor:
    """x W^T + b for an fp8 weight kept as loaded: float8_e4m3fn [N, K] with float32 scales, one per output row
    ([N]) or one per `block` ([ceil(N / rows), ceil(K / columns)]). The reference dequantizes the weight to x's
    dtype and multiplies, as a model whose weights were dequantized at load does; a kernel may quantize x to fp8
    (per token, or per group of `block`'s columns) on the way, within the tolerance the conformance suite states.
    `prepared` is what the platform's `prepare_fp8_linear` made of the weight (unused here)."""
    return F.linear(x, dequantize_fp8(weight, weight_scale, block).to(x.dtype), bias)


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """float32 [N, K]: each fp8 value times its scale (per row, or per block with the last blocks partial)."""
    rows, cols = weight.shape
    if block is None:
        return weight.float() * scale.float().reshape(rows, 1)
    per_element = scale.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return weight.float() * per_element


def int4_linear(
    x: torch.Tensor,
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_zero_point: torch.Tensor,
    bias: torch.Tensor | None,
    group_size: int,
    prepared: Any = None,
) -> torch.Tensor:
    """x W^T + b for a 4-bit weight kept packed (AWQ and GPTQ checkpoints converted at load to one layout):
    `weight_packed` int32 [N, K / 8], word c of row n holding inputs 8c..8c+7 of that row, the lowest four bits
    first; `weight_scale` float32 [N, ceil(K / group_size)] and `weight_zero_point` uint8 of the same shape, one per
    output row and group of `group_size` consecutive inputs. W[n, k] = (q - zero) x scale of k's group. The
    reference dequantizes the weight to x's dtype and multiplies, as a model whose weights were dequantized at load
    does (the same float32 products, then the same rounding). `prepared` is what the platform's
    `prepare_int4_linear` made of the weight (unused here)."""
    return F.linear(x, dequantize_int4(weight_packed, weight_scale, weight_zero_point, group_size).to(x.dtype), bias)


def unpack_int4_rows(weight_packed: torch.Tensor) -> torch.Tensor:
    """int32 [N, K / 8] -> int32 [N, K]: each word's eight 4-bit values, the lowest bits first."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=weight_packed.device)
    values = (weight_packed.unsqueeze(-1) >> shifts) & 0xF
    return values.reshape(weight_packed.shape[0], -1)


def dequantize_int4(
    weight_packed: torch.Tensor, weight_scale: torch.Tensor, weight_zero_point: torch.Tensor, group_size: int
) -> torch.Tensor:
    """float32 [N, K]: (q - zero) x scale per output row and group of inputs (the last group may be partial)."""
    q = unpack_int4_rows(weight_packed)
    group = torch.arange(q.shape[1], device=q.device) // group_size
    return (q - weight_zero_point[:, group].to(torch.int32)).float() * weight_scale[:, group].float()


# Rows per call of the batch-invariant linear: every matmul it runs has this many rows.
INVARIANT_ROWS = 32


def batch_invariant_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    prepared: Any = None,
    *,
    block_linear: Callable[..., torch.Tensor] | None = None,
) -> torch.Tensor:
    """x W^T + b computed INVARIANT_ROWS rows at a time (the last block padded with zeros), so that each row's
    result does not depend on how many rows came with it: a GEMM library picks its kernel, tiles and split of K by
    the problem's shape (torch's float32 CPU matmul changes kernel below ~8 rows), and here the shape never
    changes. Within one shape a GEMM reduces every row alike, wherever it sits. `block_linear` computes each
    block (default: `linear` above; deterministic mode passes the platform's own, which reads `prepared`)."""
    block_linear = block_linear or linear
    rows = x.reshape(-1, x.shape[-1])
    count = rows.shape[0]
    padding = -count % INVARIANT_ROWS
    if padding:
        rows = torch.cat([rows, rows.new_zeros(padding, rows.shape[1])])
    blocks = [block_linear(block, weight, bias, prepared) for block in rows.split(INVARIANT_ROWS)]
    out = torch.cat(blocks)[:count] if blocks else rows.new_empty(0, weight.shape[0])
    return out.view(*x.shape[:-1], weight.shape[0])


def prepare_linear(weight: torch.Tensor) -> Any:
    """A device-preferred form of a linear weight, made once after loading (None: use the weight as it is)."""
    return None


def takes_every_layer(out_features: int, in_features: int, layout: Any, dtype: torch.dtype) -> bool:
    """`fp8_linear_takes` / `int4_linear_takes` of a platform whose kernel serves every kept layer."""
    return True


def prepare_fp8_linear(weight: torch.Tensor, weight_scale: torch.Tensor, block: tuple[int, int] | None) -> Any:
    """A device-preferred form of a kept fp8 weight and its scales (a vendor's layout or fp8 flavour), made once
    after loading and after each weight update; None: `fp8_linear` reads them as loaded. The loaded tensors stay
    readable by weight updates and get_weights_by_name: in host memory where the form's `reads_loaded_tensors` is
    False (omnirun.layers.prepared)."""
    return None


def prepare_int4_linear(
    weight_packed: torch.Tensor, weight_scale: torch.Tensor, weight_zero_point: torch.Tensor, group_size: int
) -> Any:
    """A device-preferred form of a kept 4-bit weight (a vendor's packing), made as `prepare_fp8_linear`'s is."""
    return None


def prepare_int4_fused_moe(
    w13_packed: torch.Tensor,
    w13_scale: torch.Tensor,
    w13_zero_point: torch.Tensor,
    w2_packed: torch.Tensor,
    w2_scale: torch.Tensor,
    w2_zero_point: torch.Tensor,
    group_size: int,
) -> Any:
    """A device-preferred form of a mixture's kept 4-bit experts (a vendor's packing), made as `prepare_fp8_linear`'s
    is: after loading and after each weight update, the loaded tensors staying readable."""
    return None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / rms(x), with the statistic in float32 and the scale applied in the input dtype (as HF)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the residual add of one block fused with the next block's norm."""
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x = [gate | up] along the last dimension."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's top_k experts by softmax(router_logits) in float32, as HF's routers choose them: (float32
    weights, divided by their sum when `renormalize`; int64 expert ids), both [T, top_k]."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def fused_moe(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    renormalize: bool,
    expert_start: int = 0,
) -> torch.Tensor:
    """A mixture of experts' output for tokens x [T, H]: each token's top_k experts by softmax(router_logits [T, E])
    in float32 (weights divided by their sum when `renormalize`), each expert e computing
    w2[e] @ (silu(gate) * up) with [gate | up] = w13[e] @ x, summed with the weights. w13 [n, 2I, H] and w2 [n, H, I]
    hold experts expert_start .. expert_start + n - 1 (all E, or one rank's under expert parallelism): the others
    add nothing here. Expert by expert in ascending order, as HF transformers' MoE blocks add them."""
    weights, experts = route(router_logits, top_k, renormalize)
    weights = weights.to(x.dtype)
    out = torch.zeros_like(x)
    for expert in experts.unique().tolist():
        if not expert_start <= expert < expert_start + w13.shape[0]:
            continue
        tokens, slot = torch.where(experts == expert)
        hidden = silu_and_mul(F.linear(x[tokens], w13[expert - expert_start]))
        out.index_add_(0, tokens, F.linear(hidden, w2[expert - expert_start]) * weights[tokens, slot, None])
    return out


def fp8_fused_moe(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    top_k: int,
    renormalize: bool,
    expert_start: int = 0,
    block: tuple[int, int] | None = None,
) -> torch.Tensor:
    """`fused_moe` of experts kept in fp8 (Ops.fp8_fused_moe has the layouts): the experts dequantized to x's dtype,
    as a model whose experts were dequantized at load holds them (the same float32 products, one rounding), then
    the reference."""
    return fused_moe(
        x,
        router_logits,
        dequantize_fp8_experts(w13, w13_scale, block).to(x.dtype),
        dequantize_fp8_experts(w2, w2_scale, block).to(x.dtype),
        top_k,
        renormalize,
        expert_start,
    )


def dequantize_fp8_experts(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """float32 [n, N, K] of stacked fp8 experts [n, N, K], each by its scales (dequantize_fp8)."""
    return torch.stack([dequantize_fp8(w, s, block) for w, s in zip(weight, scale, strict=True)])


def int4_fused_moe(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    w13_packed: torch.Tensor,
    w13_scale: torch.Tensor,
    w13_zero_point: torch.Tensor,
    w2_packed: torch.Tensor,
    w2_scale: torch.Tensor,
    w2_zero_point: torch.Tensor,
    top_k: int,
    renormalize: bool,
    expert_start: int = 0,
    group_size: int = 128,
    prepared: Any = None,
) -> torch.Tensor:
    """`fused_moe` of experts kept in 4 bits (Ops.int4_fused_moe has the layouts): the experts dequantized to x's
    dtype, as a model whose experts were dequantized at load holds them, then the reference. `prepared` is what the
    platform's `prepare_int4_fused_moe` made of them (unused here)."""
    return fused_moe(
        x,
        router_logits,
        dequantize_int4_experts(w13_packed, w13_scale, w13_zero_point, group_size).to(x.dtype),
        dequantize_int4_experts(w2_packed, w2_scale, w2_zero_point, group_size).to(x.dtype),
        top_k,
        renormalize,
        expert_start,
    )


def dequantize_int4_experts(
    packed: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, group_size: int
) -> torch.Tensor:
    """float32 [n, N, K] of stacked 4-bit experts (packed [n, N, K / 8]), each by `dequantize_int4`; a group size of
    -1 is one group over the whole input."""
    group = packed.shape[-1] * 8 if group_size == -1 else group_size
    return torch.stack([dequantize_int4(*expert, group) for expert in zip(packed, scale, zero_point, strict=True)])


# argmax of fewer rows than this reduces the vocabulary in chunks of this many tokens.
_TWO_STAGE_MAX_ROWS = 32
_VOCAB_CHUNK = 4096


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Greedy sampling's pick: each row's first index of its maximum (as HF generate picks), int64 [rows]. max()
    gives the same index and is several times faster than argmax() on bf16 CPU tensors.

    A few rows over a large vocabulary are reduced in two stages (the maximum of each chunk, then of the chunks'
    maxima): one row reduced whole runs on a single block of a GPU (40 us for 128k tokens on an H200), its chunks
    on many. Taking the first chunk that holds the maximum keeps the first of equal maxima.
    """
    rows, vocab = logits.shape
    if rows >= _TWO_STAGE_MAX_ROWS or vocab < 2 * _VOCAB_CHUNK:
        return logits.max(dim=-1).indices
    whole = vocab - vocab % _VOCAB_CHUNK
    values, indices = logits[:, :whole].unflatten(1, (-1, _VOCAB_CHUNK)).max(dim=-1)
    indices = indices + torch.arange(0, whole, _VOCAB_CHUNK, device=logits.device)
    if whole < vocab:  # the last, partial chunk goes last, so that ties still resolve to the first index
        tail = logits[:, whole:].max(dim=-1)
        values = torch.cat([values, tail.values[:, None]], dim=1)
        indices = torch.cat([indices, tail.indices[:, None] + whole], dim=1)
    return indices.gather(1, values.max(dim=-1).indices[:, None]).squeeze(1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [tokens, heads*head_dim] and k [tokens, kv_heads*head_dim] by their positions (NeoX layout).

    `cos_sin_cache` is float32 [max_positions, head_dim] holding cos of the head_dim/2 frequencies, then their sin.
    """
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)
    # HF builds cos/sin for the full head as [f | f], casts them to the activation dtype, then rotates in it.
    cos = torch.cat((cos, cos), dim=-1).to(q.dtype).unsqueeze(1)
    sin = torch.cat((sin, sin), dim=-1).to(q.dtype).unsqueeze(1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x = x.view(x.shape[0], -1, head_dim)
        return ((x * cos) + (_rotate_half(x) * sin)).flatten(1)

    return rotate(q), rotate(k)
