"""Skinny matmuls (a few rows times a large weight) as a bandwidth-bound Triton kernel.

At decode batch sizes a linear layer reads its whole weight to produce a handful of rows, so its time is the
weight's bytes over memory bandwidth; vendor GEMM libraries tile for large matrices and leave some of that
bandwidth unused on small ones. Each program here owns BLOCK_N output columns and streams their weight rows
over the whole K once, with no split-K reduction kernel afterwards.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from omnirun.kernels.triton.pdl import launch_options, wait_for_previous_kernel
from omnirun.layers import native_ops

# Weights of up to this many elements go through the GEMV for one-row inputs. On an H200 (bench/gemv_sweep.py) it
# beat cuBLAS on Llama-3-8B's q/k/v (15.1 vs 15.8 us) and o (11.7 vs 13.3 us, no split-K reduce kernel) but not on
# the MLP's larger weights (56.4 vs 54.7 us, 32.4 vs 31.6 us), nor with more than one row.
GEMV_MAX_WEIGHT_ELEMENTS = 32 << 20
# The best launch of that sweep for one row, on every shape.
_ONE_ROW_LAUNCH = dict(block_n=8, block_k=1024, num_warps=4, num_stages=4)


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    K: tl.constexpr,  # a layer's in-features: few values, and a fixed trip count the compiler can pipeline
    stride_xm,
    stride_wn,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    start = 0
    if USE_PDL:
        # No kernel writes the weight: its first block is loaded before waiting for the previous kernel, so the
        # load's latency overlaps that kernel's end (without PDL this peeling only costs: measured on an H200).
        k_mask = offs_k < K
        w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        wait_for_previous_kernel(USE_PDL)
        x = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        acc += tl.sum(x[:, None, :].to(tl.float32) * w[None, :, :].to(tl.float32), axis=2)
        start = BLOCK_K
    for k0 in range(start, K, BLOCK_K):
        kk = k0 + offs_k
        k_mask = kk < K
        w = tl.load(w_rows + kk[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)  # [BN, BK]
        x = tl.load(x_rows + kk[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # [BM, BK]
        acc += tl.sum(x[:, None, :].to(tl.float32) * w[None, :, :].to(tl.float32), axis=2)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    block_n: int = 16,
    block_k: int = 512,
    num_warps: int = 4,
    num_stages: int = 3,
    pdl: bool = False,
) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T (+ bias) for small M; weight rows contiguous."""
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x,
        weight,
        bias if bias is not None else weight,
        out,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_M=triton.next_power_of_2(m),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        USE_PDL=pdl,
        num_warps=num_warps,
        num_stages=num_stages,
        **launch_options(pdl),
    )
    return out


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, prepared: Any = None, *, pdl: bool = False
) -> torch.Tensor:
    """The ops table's `linear`: the GEMV for one row and a weight small enough to gain from it, else torch's."""
    if (
        x.dim() == 2
        and x.shape[0] == 1
        and weight.numel() <= GEMV_MAX_WEIGHT_ELEMENTS
        and x.dtype == weight.dtype
        and weight.dtype in (torch.bfloat16, torch.float16)
        and x.stride(1) == 1
        and weight.stride(1) == 1
    ):
        return gemv(x, weight, bias, **_ONE_ROW_LAUNCH, pdl=pdl)
    return F.linear(x, weight, bias)


def skinny_linear_ops(pdl: bool = False) -> dict[str, Any]:
    """Op table entries for a platform's `fused_ops` (the weight is used as loaded: no prepared form); `pdl`: the
    GEMV launched with programmatic dependent launch (`omnirun.kernels.triton.pdl`)."""
    return {
        "linear": functools.partial(linear, pdl=True) if pdl else linear,
        "prepare_linear": native_ops.prepare_linear,
    }
