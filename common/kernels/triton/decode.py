"""Paged decode attention in Triton: one query token per request, split-K over the request's cached keys.

Stage 1 runs one program per (request, KV head, split). It walks its split of the request's positions through the
request-to-token table, gathers K/V rows of its KV head once and scores every query head of that head's GQA group
against them (the group padded to >= 16 rows so `tl.dot` applies), with an online softmax in float32. It writes the
split's normalised partial output and its log-sum-exp. Stage 2 merges the splits of each (request, head).

The number of splits is fixed by the caller's partial buffers, not by the sequence lengths, so one launch serves
every batch of a captured graph; splits that are empty for a short sequence (or below the sliding window) record a
log-sum-exp of -inf and are left out of the merge. With one split (large batches, which fill the GPU without
splitting) stage 1 writes the output itself and stage 2 does not run: no partials go through memory.

Kernels work in base 2 (exp2/log2, the softmax scale pre-multiplied by log2(e)): exp2 is the native instruction.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from omnirun.kernels.triton.pdl import launch_options, wait_for_previous_kernel

LOG2E = 1.4426950408889634
# Requests are the grid's second axis, which CUDA caps at 65,535 programs.
MAX_DECODE_BATCH = 65535

# bfloat16 tl.dot multiplies bit patterns in the Triton interpreter (triton-lang/triton#11584): there the dot
# operands are widened to float32, after rounding to the query dtype so the numbers match the compiled kernel.
_INTERPRETING = bool(triton.knobs.runtime.interpret)


def dot_dtype(q_dtype: torch.dtype) -> tl.dtype:
    """The element type the kernels feed `tl.dot` for queries of `q_dtype`."""
    if _INTERPRETING or q_dtype == torch.float32:
        return tl.float32
    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[q_dtype]


def head_block(head_dim: int) -> int:
    """The padded head-dim tile: a power of two, at least 16 (the smallest `tl.dot` operand)."""
    return max(16, triton.next_power_of_2(head_dim))


@triton.jit
def online_softmax_block(q, k, v, mask, acc, l_i, m_i, scale_log2, Q_TY: tl.constexpr, DOT_TY: tl.constexpr):
    """One key block of the online softmax: q [M, D], k/v [N, D] as loaded, mask [M, N] (True = attend).

    Returns the updated (acc [M, D], l_i [M], m_i [M]), all float32; m_i is in base-2 units. Rows with no key
    attended so far keep m_i = -inf and contribute nothing (their max is replaced by 0 before subtracting)."""
    # K/V go through the query dtype first (as the reference casts the cache to q.dtype): exact for fp8 storage.
    qk = tl.dot(q, tl.trans(k.to(Q_TY).to(DOT_TY)), input_precision="ieee") * scale_log2
    qk = tl.where(mask, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_sub)
    p = tl.exp2(qk - m_sub[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    pv = tl.dot(p.to(Q_TY).to(DOT_TY), v.to(Q_TY).to(DOT_TY), input_precision="ieee")
    acc = acc * alpha[:, None] + pv
    return acc, l_i, m_new


@triton.jit
def _decode_split_kernel(
    Q,
    K_cache,
    V_cache,
    req_to_token,
    req_rows,
    seq_lens,
    part_out,
    part_lse,
    Out,
    scale_log2,
    window,
    stride_qb,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_table,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_TY: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # A request's KV heads are adjacent programs (the grid's fastest axis), so they run at about the same time and
    # read neighbouring bytes of the same cache rows (a slot's heads are contiguous): on an H200 3-4 % faster at
    # 256-512 requests than with requests along the fastest axis, the same at 1-32 under PDL
    # (bench/results/h200_decode_grid_order.json).
    kv_head = tl.program_id(0)
    b = tl.program_id(1)
    split = tl.program_id(2)

    # The request's row and length are written before the step, never by the kernel just before this one (the KV
    # store): under PDL they load ahead of the wait, one link less in the chain row -> table -> K/V after it.
    row = tl.load(req_rows + b).to(tl.int64)
    seq_len = tl.load(seq_lens + b)
    wait_for_previous_kernel(USE_PDL)  # before touching q, the cache or the outputs (even an empty split's lse)
    # Splits start on BLOCK_N boundaries so every block but a split's last is full.
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * split_len
    hi = tl.minimum(lo + split_len, seq_len)
    if USE_WINDOW:
        # The query sits at seq_len - 1 and sees keys at positions > seq_len - 1 - window.
        lo = tl.maximum(lo, seq_len - window)

    offs_h = tl.arange(0, BLOCK_H)
    mask_h = offs_h < GROUP
    heads = kv_head * GROUP + offs_h
    lse_ptrs = part_lse + b * stride_lb + heads * stride_lh + split
    if lo >= hi:
        # An empty split (short sequence, or wholly below the window): lse = -inf, which the merge skips.
        tl.store(lse_ptrs, tl.full([BLOCK_H], float("-inf"), dtype=tl.float32), mask=mask_h)
        return
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM

    Q_TY: tl.constexpr = Q.dtype.element_ty
    q_ptrs = Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=mask_h[:, None] & mask_d[None, :], other=0.0)
    q = q.to(DOT_TY)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    table_row = req_to_token + row * stride_table
    k_head = K_cache + kv_head * stride_kh
    v_head = V_cache + kv_head * stride_vh
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < hi
        # int64 before multiplying: slot * stride overflows int32 on large pools.
        slots = tl.load(table_row + offs_n, mask=mask_n, other=0).to(tl.int64)
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(k_head + slots[:, None] * stride_ks + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_head + slots[:, None] * stride_vs + offs_d[None, :], mask=kv_mask, other=0.0)
        acc, l_i, m_i = online_softmax_block(q, k, v, mask_n[None, :], acc, l_i, m_i, scale_log2, Q_TY, DOT_TY)

    # Every block holds a key (it starts below hi), so l_i > 0 and m_i is finite for every row.
    mask_out = mask_h[:, None] & mask_d[None, :]
    if NUM_SPLITS == 1:
        out_ptrs = Out + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(out_ptrs, (acc / l_i[:, None]).to(Out.dtype.element_ty), mask=mask_out)
    else:
        out_ptrs = part_out + b * stride_pb + heads[:, None] * stride_ph + split * stride_ps + offs_d[None, :]
        tl.store(out_ptrs, acc / l_i[:, None], mask=mask_out)
        tl.store(lse_ptrs, m_i + tl.log2(l_i), mask=mask_h)


@triton.jit
def _decode_merge_kernel(
    part_out,
    part_lse,
    Out,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_previous_kernel(USE_PDL)
    b = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM

    lse = tl.load(part_lse + b * stride_lb + head * stride_lh + offs_s, mask=offs_s < NUM_SPLITS, other=float("-inf"))
    valid = lse > float("-inf")
    # Every sequence has >= 1 key, so at least one split is valid and lse_max is finite.
    lse_max = tl.max(lse, 0)
    weights = tl.where(valid, tl.exp2(lse - lse_max), 0.0)
    parts = tl.load(
        part_out + b * stride_pb + head * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :],
        mask=valid[:, None] & mask_d[None, :],
        other=0.0,
    )
    out = tl.sum(parts * weights[:, None], 0) / tl.sum(weights, 0)
    tl.store(Out + b * stride_ob + head * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=mask_d)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_rows: torch.Tensor,
    seq_lens: torch.Tensor,
    part_out: torch.Tensor,
    part_lse: torch.Tensor,
    out: torch.Tensor,
    scaling: float,
    sliding_window: int | None = None,
    *,
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
    pdl: bool = False,
) -> None:
    """Decode attention of `q` over each request's cached keys, written into `out`.

    q, out: [batch, heads, head_dim] (last dim contiguous); k_cache, v_cache: [slots, kv_heads, head_dim] in the
    storage dtype; req_to_token: int32 [rows, max_context_len]; req_rows: [>= batch] request rows; seq_lens:
    int32 [>= batch], keys per request including the query's own. part_out: float32 [>= batch, heads, splits,
    head_dim] and part_lse: float32 [>= batch, heads, splits] are scratch (views with strides are fine); their split
    count is the split count. pdl: both stages launched with programmatic dependent launch (`kernels.triton.pdl`).
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    num_splits = part_out.shape[2]
    if num_heads % num_kv_heads or k_cache.shape[2] != head_dim or out.shape != q.shape:
        raise ValueError(
            f"decode_attention: q {tuple(q.shape)}, out {tuple(out.shape)} and cache {tuple(k_cache.shape)} disagree"
        )
    if part_out.shape[0] < batch or part_out.shape[1] != num_heads or part_out.shape[3] != head_dim:
        raise ValueError(f"decode_attention: part_out {tuple(part_out.shape)} does not fit q {tuple(q.shape)}")
    if batch > MAX_DECODE_BATCH:
        raise ValueError(
            f"decode_attention: {batch} requests in one step, at most {MAX_DECODE_BATCH} (the grid's second axis): "
            "lower --max-running-requests"
        )
    if batch == 0:
        return
    group = num_heads // num_kv_heads
    block_d = head_block(head_dim)
    if q.element_size() == 4:
        # float32 tiles take twice the shared memory: halve the key block to stay within AMD's 64 KiB LDS.
        block_n = min(block_n, 32)
    use_window = sliding_window is not None
    _decode_split_kernel[(num_kv_heads, batch, num_splits)](
        q,
        k_cache,
        v_cache,
        req_to_token,
        req_rows,
        seq_lens,
        part_out,
        part_lse,
        out,
        scaling * LOG2E,
        sliding_window if use_window else 0,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        req_to_token.stride(0),
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        NUM_SPLITS=num_splits,
        USE_WINDOW=use_window,
        DOT_TY=dot_dtype(q.dtype),
        USE_PDL=pdl,
        num_warps=num_warps,
        num_stages=num_stages,
        **launch_options(pdl),
    )
    if num_splits == 1:
        return  # the split stage wrote the output
    _decode_merge_kernel[(batch, num_heads)](
        part_out,
        part_lse,
        out,
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        NUM_SPLITS=num_splits,
        BLOCK_S=triton.next_power_of_2(num_splits),
        USE_PDL=pdl,
        num_warps=4 if block_d <= 128 else 8,
        **launch_options(pdl),
    )


def partial_buffers(
    batch: int, num_heads: int, num_splits: int, head_dim: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scratch for `decode_attention`: (part_out [batch, heads, splits, head_dim], part_lse [batch, heads, splits])."""
    part_out = torch.empty((batch, num_heads, num_splits, head_dim), dtype=torch.float32, device=device)
    part_lse = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=device)
    return part_out, part_lse
