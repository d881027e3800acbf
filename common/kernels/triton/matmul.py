"""A batch-invariant matmul in Triton: y = x W^T + b whose every element is reduced in the same order for any
number of rows (deterministic mode's linear layers; vLLM's batch-invariant mode uses a Triton matmul likewise).

cuBLAS picks its kernel, tiles and split-K by the problem's shape, so a row's result changes with the batch around
it. Here the tiles are a function of the weight's shape alone (never of the row count): each output element sums
K in blocks of BLOCK_K, left to right, with the same `tl.dot` shapes, whatever M is and wherever its row falls in
a tile. No split-K: the reduction of one element never leaves its program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_INTERPRETING = bool(triton.knobs.runtime.interpret)
BLOCK_M = 64
BLOCK_K = 64


@triton.jit
def _matmul_kernel(
    X,
    W,
    Bias,
    Out,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_TY: tl.constexpr,
):
    # Programs that share a block of W's rows run next to each other, so a weight tile read by one stays in L2
    # for the next row block (what makes large batches read the weights about once).
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m

    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        mask_k = ks < K
        x = tl.load(X + offs_m[:, None] * stride_xm + ks[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(W + offs_n[None, :] * stride_wn + ks[:, None], mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        acc = tl.dot(x.to(DOT_TY), w.to(DOT_TY), acc, input_precision="ieee")
    if HAS_BIAS:
        acc += tl.load(Bias + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    out_ptrs = Out + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(Out.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def block_n(out_features: int) -> int:
    """Output columns per program, from the weight's shape alone: narrow tiles give a narrow layer enough programs
    to stream its weight on a large GPU at batch 1, wide ones read x fewer times."""
    return 32 if out_features <= 8192 else 64


def batch_invariant_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, prepared: object = None
) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T (+ bias [N]) -> [..., N] in x's dtype; `prepared` is unused (plain weights)."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    m, k = rows.shape
    n = weight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m and n:
        tile_n = block_n(n)
        grid = (triton.cdiv(m, BLOCK_M) * triton.cdiv(n, tile_n),)
        # The interpreter's bf16 tl.dot multiplies bit patterns (triton-lang/triton#11584): float32 there.
        dot_ty = tl.float32 if _INTERPRETING or x.dtype == torch.float32 else tl.bfloat16
        if x.dtype == torch.float16 and not _INTERPRETING:
            dot_ty = tl.float16
        _matmul_kernel[grid](
            rows,
            weight,
            bias if bias is not None else weight,
            out,
            m,
            n,
            k,
            rows.stride(0),
            weight.stride(0),
            out.stride(0),
            HAS_BIAS=bias is not None,
            BLOCK_M=BLOCK_M,
            BLOCK_N=tile_n,
            BLOCK_K=BLOCK_K,
            GROUP_M=8,
            DOT_TY=dot_ty,
            num_warps=4,
            num_stages=4,
        )
    return out.view(*x.shape[:-1], n)
