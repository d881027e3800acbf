"""Linear layers on fp8 weights (float8_e4m3fn [N, K], float32 scales per output row or per block): the op table's
`fp8_linear` as portable Triton kernels.

- `weight_only`: for a few rows (decode), activations stay in the model dtype and each weight tile is widened as it
  is read: the layer costs its fp8 bytes, half of bf16's. One-row inputs reduce along K on the CUDA cores (the
  shape the bf16 GEMV measured best), more rows use tensor-core dots on 16-row tiles.
- `w8a8_block`: for many rows, each row's activations are quantized to fp8 per group of the block's columns inside
  the GEMM (the group's amax / 448, as DeepSeek-V3's and transformers' FineGrainedFP8 act_quant do), so the dots run
  on fp8 tensor cores at twice bf16's rate; per-row weight scales take the same kernel with a block as wide as K.
- `quantize_per_token`: a row's amax / 448 and its fp8 values, for a GEMM library's row-wise scaled matmul.

Rounding to e4m3 is written out (round half to even on the fp8 grid, then an exact cast): Triton's interpreter
rounds some values wrongly when the mantissa carries into the exponent, and the written-out rounding gives the same
bits as torch's cast on every device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from omnirun.kernels.triton.modes import INTERPRETED
from omnirun.layers import native_ops

E4M3_MAX = 448.0
# The K step of both GEMMs; a block's columns must be a multiple (every fp8 checkpoint's 128 is).
BLOCK_K = 128


@triton.jit
def _round_to_e4m3(x):
    """float32 -> the nearest float8_e4m3fn value (ties to even), still in float32; |x| <= 448 assumed."""
    exponent = ((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    # e4m3 keeps 3 mantissa bits from 2^-6 up; below, subnormal steps of 2^-9. Powers of two built from their bits
    # scale exactly (no approximate exp2 or division).
    step_exponent = tl.maximum(exponent, -6) - 3
    step = ((step_exponent + 127) << 23).to(tl.float32, bitcast=True)
    inverse = ((127 - step_exponent) << 23).to(tl.float32, bitcast=True)
    magic = 12582912.0  # 1.5 * 2^23: adding and subtracting it rounds a float32 below 2^22 to an integer, ties even
    return ((x * inverse + magic) - magic) * step


@triton.jit
def _quantize_group(x, QUANT_MAX: tl.constexpr):
    """x [rows, group] float32 -> (fp8 values as float32, each row's scale [rows]), divided as IEEE does."""
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.div_rn(tl.maximum(amax, 1e-12), QUANT_MAX)
    q = _round_to_e4m3(tl.minimum(tl.maximum(tl.div_rn(x, scale[:, None]), -QUANT_MAX), QUANT_MAX))
    return q, scale


@triton.jit
def _weight_only_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_ym,
    SCALE_ROWS: tl.constexpr,  # output rows per scale row: 1 (per-row scales) or the block's rows
    SCALE_COLS: tl.constexpr,  # input columns per scale column: 0 (one scale per row) or the block's columns
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    offs_k = tl.arange(0, BLOCK_K)
    scale_rows = s_ptr + (offs_n // SCALE_ROWS).to(tl.int64) * stride_sn
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        k_mask = kk < K
        w = tl.load(w_rows + kk[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)  # [BN, BK] fp8
        x = tl.load(x_rows + kk[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # [BM, BK]
        if BLOCK_M == 1:
            part = tl.sum(x.to(tl.float32) * w.to(tl.float32), axis=1)[None, :]
        elif INTERPRETED:  # the interpreter's dot multiplies 16-bit floats' raw bits: give it float32
            part = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)))
        else:
            part = tl.dot(x, tl.trans(w.to(x.dtype)))
        if SCALE_COLS > 0:  # block scales change along K: apply each block's as its columns are summed
            part = part * tl.load(scale_rows + k0 // SCALE_COLS, mask=n_mask, other=0.0)[None, :]
        acc += part
    if SCALE_COLS == 0:
        acc = acc * tl.load(scale_rows, mask=n_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _w8a8_block_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_ym,
    SCALE_ROWS: tl.constexpr,
    SCALE_COLS: tl.constexpr,  # 0: one scale per row, applied once at the end
    QUANT_MAX: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # Tiles walked in groups of GROUP_M rows of tiles, so that neighbouring programs share weight tiles in L2.
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    scale_rows = s_ptr + (offs_n // SCALE_ROWS).to(tl.int64) * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        k_mask = kk < K
        x = tl.load(x_rows + kk[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        xq, x_scale = _quantize_group(x, QUANT_MAX)
        w = tl.load(w_rows + kk[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        part = tl.dot(xq.to(w.dtype), tl.trans(w)) * x_scale[:, None]
        if SCALE_COLS > 0:
            part = part * tl.load(scale_rows + k0 // SCALE_COLS, mask=n_mask, other=0.0)[None, :]
        acc += part
    if SCALE_COLS == 0:
        acc = acc * tl.load(scale_rows, mask=n_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _quantize_per_token_kernel(
    x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, QUANT_MAX: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        x = tl.load(x_ptr + row * stride_xm + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.div_rn(tl.maximum(tl.max(amax, axis=0), 1e-12), QUANT_MAX)
    for k0 in range(0, K, BLOCK):
        mask = k0 + offs < K
        x = tl.load(x_ptr + row * stride_xm + k0 + offs, mask=mask, other=0.0).to(tl.float32)
        q = _round_to_e4m3(tl.minimum(tl.maximum(tl.div_rn(x, scale), -QUANT_MAX), QUANT_MAX))
        tl.store(q_ptr + row * stride_qm + k0 + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row, scale)


def _scale_layout(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> tuple[int, int, int]:
    """(output rows per scale row, input columns per scale column or 0, the scale's row stride)."""
    if block is None:
        return 1, 0, 1
    if block[1] % BLOCK_K:
        raise ValueError(f"fp8 blocks of {block[1]} columns: the Triton fp8 GEMMs need a multiple of {BLOCK_K}")
    return block[0], block[1], scale.stride(0)


def weight_only(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    block: tuple[int, int] | None,
    *,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int = 4,
) -> torch.Tensor:
    """x [M, K] (M <= 16, bf16/fp16) times the fp8 weight, activations unquantized."""
    m, k = x.shape
    n = weight.shape[0]
    rows_per_scale, cols_per_scale, scale_stride = _scale_layout(weight, scale, block)
    block_m = 1 if m == 1 else 16
    block_n = block_n or (16 if m == 1 else 64)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _weight_only_kernel[(triton.cdiv(n, block_n),)](
        x,
        weight,
        scale,
        bias if bias is not None else scale,
        out,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        scale_stride,
        out.stride(0),
        SCALE_ROWS=rows_per_scale,
        SCALE_COLS=cols_per_scale,
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=BLOCK_K,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


def w8a8_block(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    block: tuple[int, int] | None,
    *,
    block_m: int = 64,
    block_n: int = 128,
    num_warps: int = 4,
    num_stages: int = 3,
) -> torch.Tensor:
    """x [M, K] quantized per token and group of BLOCK_K columns, times the fp8 weight, on fp8 tensor cores."""
    m, k = x.shape
    n = weight.shape[0]
    rows_per_scale, cols_per_scale, scale_stride = _scale_layout(weight, scale, block)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _w8a8_block_kernel[grid](
        x,
        weight,
        scale,
        bias if bias is not None else scale,
        out,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        scale_stride,
        out.stride(0),
        SCALE_ROWS=rows_per_scale,
        SCALE_COLS=cols_per_scale,
        QUANT_MAX=E4M3_MAX,
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=BLOCK_K,
        GROUP_M=8,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn [M, K], float32 [M, 1] scales) with x ~ q x scale, each row's scale its amax / 448."""
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m:
        block = min(2048, triton.next_power_of_2(k))
        _quantize_per_token_kernel[(m,)](x, q, scale, k, x.stride(0), q.stride(0), QUANT_MAX=E4M3_MAX, BLOCK=block)
    return q, scale


# Rows up to which the weight-only kernel serves: beyond, fp8 tensor cores beat widening the weight.
WEIGHT_ONLY_MAX_ROWS = 16


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    block: tuple[int, int] | None,
) -> torch.Tensor:
    """The op table's `fp8_linear` (omnirun.layers.native_ops.fp8_linear's contract) in Triton alone."""
    if x.dtype not in (torch.bfloat16, torch.float16):
        return native_ops.fp8_linear(x, weight, weight_scale, bias, block)  # float32 models: the reference
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if block is not None and block[1] % BLOCK_K:  # no published checkpoint has such blocks: correct, not fast
        return native_ops.fp8_linear(x, weight, weight_scale, bias, block)
    if rows.shape[0] <= WEIGHT_ONLY_MAX_ROWS:
        out = weight_only(rows, weight, weight_scale, bias, block)
    else:
        out = w8a8_block(rows, weight, weight_scale, bias, block)
    return out.reshape(*x.shape[:-1], weight.shape[0])
