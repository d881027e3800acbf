"""Paged prefill/extend attention in Triton: new tokens of each request over its cached prefix and themselves.

One program per (request, query head, block of BLOCK_M new tokens). The new tokens are already in the KV cache
(the backend stores them first), so all keys are read through the request-to-token table. A program walks the keys
in two phases: those before its first query position, which every query of the block sees (no causal mask), then
the diagonal blocks up to its last query position, with the causal mask (with `aligned`, one masked walk over
blocks counted from position 0 instead: deterministic mode). Blocks wholly before the sliding window of
the block's first query are skipped. Online softmax in float32, base 2 (see decode.py).
"""

from __future__ import annotations

import inspect

import torch
import triton
import triton.language as tl

from omnirun.kernels.triton.decode import LOG2E, dot_dtype, head_block, online_softmax_block


@triton.jit
def _key_block(
    q, start, end, table_row, k_head, v_head, stride_ks, stride_vs, offs_d, mask_d, q_pos, window,
    acc, l_i, m_i, scale_log2,
    CAUSAL: tl.constexpr, USE_WINDOW: tl.constexpr, BLOCK_N: tl.constexpr, Q_TY: tl.constexpr, DOT_TY: tl.constexpr,
):  # fmt: skip
    """Keys start..start+BLOCK_N-1 (those before `end`) through the request's table row, into the online softmax;
    CAUSAL masks keys past each query's position, USE_WINDOW those before its window."""
    offs_n = start + tl.arange(0, BLOCK_N)
    mask_n = offs_n < end
    slots = tl.load(table_row + offs_n, mask=mask_n, other=0).to(tl.int64)
    kv_mask = mask_n[:, None] & mask_d[None, :]
    k = tl.load(k_head + slots[:, None] * stride_ks + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_head + slots[:, None] * stride_vs + offs_d[None, :], mask=kv_mask, other=0.0)
    mask = mask_n[None, :]
    if CAUSAL:
        mask = mask & (offs_n[None, :] <= q_pos[:, None])
    if USE_WINDOW:
        mask = mask & (offs_n[None, :] > q_pos[:, None] - window)
    return online_softmax_block(q, k, v, mask, acc, l_i, m_i, scale_log2, Q_TY, DOT_TY)


# The per-request metadata are rows of packed tensors, so whether each starts 16-byte aligned depends on the batch
# size, and Triton compiles one variant per combination of alignments on first launch: on a fresh H100 server the
# first requests of some batch sizes waited up to 0.7 s for one (the warm-up met others). The kernel loads them
# one scalar at a time, which alignment does not speed up: one variant serves every batch size (older triton
# releases lack the option and specialise as before).
_METADATA = ["req_rows", "q_starts", "extend_lens", "prefix_lens"]
_ANY_ALIGNMENT = (
    {"do_not_specialize_on_alignment": _METADATA}
    if "do_not_specialize_on_alignment" in inspect.signature(triton.jit).parameters
    else {}
)


@triton.jit(**_ANY_ALIGNMENT)
def _extend_kernel(
    Q,
    K_cache,
    V_cache,
    Out,
    req_to_token,
    req_rows,
    q_starts,
    extend_lens,
    prefix_lens,
    scale_log2,
    window,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_table,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    ALIGNED: tl.constexpr,
    DOT_TY: tl.constexpr,
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    m_start = tl.program_id(2) * BLOCK_M
    extend_len = tl.load(extend_lens + req)
    if m_start >= extend_len:  # the grid is sized for the longest request
        return
    prefix_len = tl.load(prefix_lens + req)
    q_start = tl.load(q_starts + req).to(tl.int64)
    row = tl.load(req_rows + req).to(tl.int64)
    kv_head = head // GROUP

    offs_m = m_start + tl.arange(0, BLOCK_M)
    mask_m = offs_m < extend_len
    q_pos = prefix_len + offs_m
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    Q_TY: tl.constexpr = Q.dtype.element_ty
    q_ptrs = Q + (q_start + offs_m[:, None]) * stride_qt + head * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=mask_m[:, None] & mask_d[None, :], other=0.0).to(DOT_TY)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    table_row = req_to_token + row * stride_table
    k_head = K_cache + kv_head * stride_kh
    v_head = V_cache + kv_head * stride_vh

    first_q = prefix_len + m_start  # every query of the block sees all keys before this position
    last_q_end = tl.minimum(prefix_len + extend_len, first_q + BLOCK_M)  # no query of the block sees keys past here
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(first_q - window + 1, 0)

    if ALIGNED:
        # Deterministic mode: one causally masked walk over key blocks counted from position 0, so a query meets
        # the same blocks (the same reduction order) however its prompt was chunked or cached. A block wholly
        # masked for a query leaves its state exactly as it was (alpha 1, p 0), so the tile's extent is harmless.
        for start in range((lo // BLOCK_N) * BLOCK_N, last_q_end, BLOCK_N):
            acc, l_i, m_i = _key_block(
                q, start, last_q_end, table_row, k_head, v_head, stride_ks, stride_vs, offs_d, mask_d, q_pos, window,
                acc, l_i, m_i, scale_log2, True, USE_WINDOW, BLOCK_N, Q_TY, DOT_TY,
            )  # fmt: skip
    else:
        # Phase 1: keys before the block's first query; only the window (and the phase's end) masks them.
        for start in range(lo, first_q, BLOCK_N):
            acc, l_i, m_i = _key_block(
                q, start, first_q, table_row, k_head, v_head, stride_ks, stride_vs, offs_d, mask_d, q_pos, window,
                acc, l_i, m_i, scale_log2, False, USE_WINDOW, BLOCK_N, Q_TY, DOT_TY,
            )  # fmt: skip
        # Phase 2: the diagonal, keys from the first query's position up to the last one's, causally masked.
        for start in range(first_q, last_q_end, BLOCK_N):
            acc, l_i, m_i = _key_block(
                q, start, last_q_end, table_row, k_head, v_head, stride_ks, stride_vs, offs_d, mask_d, q_pos, window,
                acc, l_i, m_i, scale_log2, True, USE_WINDOW, BLOCK_N, Q_TY, DOT_TY,
            )  # fmt: skip

    # Every real query sees at least itself, so l_i > 0 on the rows that are stored.
    l_div = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_div[:, None]
    o_ptrs = Out + (q_start + offs_m[:, None]) * stride_ot + head * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


def extend_tiles(head_dim: int, q_dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps): 128x64 tiles up to head_dim 128, 64x64 past it, 64x32 for float32 queries
    (whose tiles take twice the shared memory; AMD has 64 KiB of it)."""
    block_d = head_block(head_dim)
    num_warps = 4 if block_d <= 64 else 8
    if q_dtype.itemsize == 4:
        return 64, 32, num_warps
    return (128 if block_d <= 128 else 64), 64, num_warps


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    req_to_token: torch.Tensor,
    req_rows: torch.Tensor,
    q_starts: torch.Tensor,
    extend_lens: torch.Tensor,
    prefix_lens: torch.Tensor,
    max_extend_len: int,
    scaling: float,
    sliding_window: int | None = None,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 1,
    aligned: bool = False,
) -> None:
    """Causal attention of each request's new tokens over its cached prefix and themselves, written into `out`.

    q, out: [tokens, heads, head_dim] (last dim contiguous), request after request; k_cache, v_cache: [slots,
    kv_heads, head_dim] in the storage dtype, already holding the new tokens; req_to_token: int32 [rows,
    max_context_len]. Per request, on q's device: req_rows (table row), q_starts (first token in q), extend_lens
    (new tokens), prefix_lens (tokens cached before them). max_extend_len: the largest extend len (a host int).
    aligned: walk the keys in blocks counted from position 0 (deterministic mode: chunking and prefix caching do
    not change a query's result).
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    if num_heads % num_kv_heads or k_cache.shape[2] != head_dim or out.shape != q.shape:
        raise ValueError(
            f"extend_attention: q {tuple(q.shape)}, out {tuple(out.shape)} and cache {tuple(k_cache.shape)} disagree"
        )
    num_requests = req_rows.shape[0]
    if num_tokens == 0 or num_requests == 0 or max_extend_len < 1:
        return
    default_m, default_n, default_warps = extend_tiles(head_dim, q.dtype)
    block_m = block_m or default_m
    block_n = block_n or default_n
    use_window = sliding_window is not None
    grid = (num_requests, num_heads, triton.cdiv(max_extend_len, block_m))
    _extend_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        req_to_token,
        req_rows,
        q_starts,
        extend_lens,
        prefix_lens,
        scaling * LOG2E,
        sliding_window if use_window else 0,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        req_to_token.stride(0),
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=head_block(head_dim),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        USE_WINDOW=use_window,
        ALIGNED=aligned,
        DOT_TY=dot_dtype(q.dtype),
        num_warps=num_warps or default_warps,
        num_stages=num_stages,
    )
