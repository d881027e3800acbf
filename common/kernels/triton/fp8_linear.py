"""Linear layers on fp8 weights (float8_e4m3fn [N, K], float32 scales per output row or per block): the op table's
`fp8_linear` as portable Triton kernels.

- `weight_only`: for a few rows (decode), activations stay in the model dtype and each weight tile is widened as it
  is read: the layer costs its fp8 bytes, half of bf16's. One-row inputs reduce along K on the CUDA cores (the
  shape the bf16 GEMV measured best), more rows use tensor-core dots on 16-row tiles.
- `w8a8`: for many rows, each row's activations are first quantized to fp8 per group of 128 columns (the group's
  amax / 448, as DeepSeek-V3's and transformers' FineGrainedFP8 act_quant do), then the dots run on fp8 tensor
  cores at twice bf16's rate, each K step scaled by its activation and weight scales.
- `quantize`: fp8 values and their amax / 448 scales per row, or per row and group of columns (a GEMM library's
  row-wise scaled matmul takes the former).

Rounding to e4m3 is written out (round half to even on the fp8 grid, then an exact cast): Triton's interpreter
rounds some values wrongly when the mantissa carries into the exponent, and the written-out rounding gives the same
bits as torch's cast on every device.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from omnirun.kernels.triton.modes import INTERPRETED
from omnirun.kernels.triton.tiles import l2_grouped_tile
from omnirun.layers import native_ops

E4M3_MAX = 448.0
# The W8A8 GEMM's K step and activation group; a block's columns must be a multiple (every fp8 checkpoint's 128 is).
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
def _weight_only_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    K: tl.constexpr,  # a layer's in-features: few values, and a fixed trip count the compiler can pipeline
    stride_xm,
    stride_wn,
    stride_sn,
    stride_ym,
    SCALE_ROWS: tl.constexpr,  # output rows per scale row: 1 (per-row scales) or the block's rows
    SCALE_COLS: tl.constexpr,  # input columns per scale column: 0 (one scale per row) or the block's columns
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # a multiple of SCALE_COLS' sub-blocks: see GROUP
):
    # With block scales a K tile holds BLOCK_K // GROUP groups of columns sharing a scale per row.
    GROUP: tl.constexpr = BLOCK_K if SCALE_COLS == 0 else min(SCALE_COLS, BLOCK_K)
    # One row against block scales whose rows hold whole programs: every row of a program shares its scales.
    SHARED_SCALE_ROW: tl.constexpr = BLOCK_M == 1 and SCALE_COLS > 0 and SCALE_ROWS % BLOCK_N == 0
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    offs_k = tl.arange(0, BLOCK_K)
    offs_g = tl.arange(0, BLOCK_K // GROUP)
    scale_rows = s_ptr + (offs_n // SCALE_ROWS).to(tl.int64) * stride_sn
    shared_scales = s_ptr + ((pid * BLOCK_N) // SCALE_ROWS).to(tl.int64) * stride_sn
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        k_mask = kk < K
        w = tl.load(w_rows + kk[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        x = tl.load(x_rows + kk[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # [BM, BK]
        if SHARED_SCALE_ROW:  # the program's row of block scales, one per group: [BK // GROUP]
            column = (k0 + offs_g * GROUP) // SCALE_COLS
            s_shared = tl.load(shared_scales + column, mask=column < tl.cdiv(K, SCALE_COLS), other=0.0)
        elif SCALE_COLS > 0:  # this tile's block scales, one per row and group: [BN, BK // GROUP]
            column = (k0 + offs_g * GROUP) // SCALE_COLS
            s = tl.load(
                scale_rows[:, None] + column[None, :], mask=n_mask[:, None] & (column < tl.cdiv(K, SCALE_COLS))[None, :]
            )
        if BLOCK_M == 1 and SHARED_SCALE_ROW:  # one row, the program's rows in one row of blocks: scale x's groups
            # (one multiply per input, not per weight), then one reduction per row as with per-row scales
            xs = tl.reshape(tl.reshape(x.to(tl.float32), (BLOCK_K // GROUP, GROUP)) * s_shared[:, None], (1, BLOCK_K))
            acc += tl.sum(w * xs, axis=1)[None, :]
        elif BLOCK_M == 1:  # one row: multiply and reduce on the CUDA cores, scaling each group's sum
            products = w * x.to(tl.float32)
            if SCALE_COLS > 0:
                sums = tl.sum(tl.reshape(products, (BLOCK_N, BLOCK_K // GROUP, GROUP)), axis=2)
                acc += tl.sum(sums * s, axis=1)[None, :]
            else:
                acc += tl.sum(products, axis=1)[None, :]
        else:  # tensor-core dots on the weight widened (and, with blocks, scaled) in registers
            if SCALE_COLS > 0:
                w = tl.reshape(tl.reshape(w, (BLOCK_N, BLOCK_K // GROUP, GROUP)) * s[:, :, None], (BLOCK_N, BLOCK_K))
            if INTERPRETED:  # the interpreter's dot multiplies 16-bit floats' raw bits: give it float32
                acc += tl.dot(x.to(tl.float32), tl.trans(w))
            else:
                acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    if SCALE_COLS == 0:
        acc = acc * tl.load(scale_rows, mask=n_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _w8a8_kernel(
    q_ptr,
    qs_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_qm,
    stride_qsm,
    stride_wn,
    stride_sn,
    stride_ym,
    SCALE_ROWS: tl.constexpr,
    SCALE_COLS: tl.constexpr,  # 0: one scale per row, applied once at the end
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # the activations' quantization group: one activation scale per row and K step
    GROUP_M: tl.constexpr,
):
    pid_m, pid_n = l2_grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    q_rows = q_ptr + offs_m[:, None].to(tl.int64) * stride_qm
    qs_rows = qs_ptr + offs_m.to(tl.int64) * stride_qsm
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    scale_rows = s_ptr + (offs_n // SCALE_ROWS).to(tl.int64) * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        k_mask = kk < K
        q = tl.load(q_rows + kk[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_rows + kk[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        part = tl.dot(q, tl.trans(w)) * tl.load(qs_rows + k0 // BLOCK_K, mask=m_mask, other=0.0)[:, None]
        if SCALE_COLS > 0:
            part = part * tl.load(scale_rows + k0 // SCALE_COLS, mask=n_mask, other=0.0)[None, :]
        acc += part
    if SCALE_COLS == 0:
        acc = acc * tl.load(scale_rows, mask=n_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _quantize_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    K,
    stride_xm,
    stride_qm,
    stride_sm,
    QUANT_MAX: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Row `program_id(0)`'s groups of GROUP columns (all of K for one group per row), each scaled by its amax."""
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    start = group * GROUP
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for k0 in range(start, start + GROUP, BLOCK):
        x = tl.load(x_ptr + row * stride_xm + k0 + offs, mask=(k0 + offs < K) & (offs < GROUP), other=0.0)
        amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
    scale = tl.div_rn(tl.maximum(tl.max(amax, axis=0), 1e-12), QUANT_MAX)
    for k0 in range(start, start + GROUP, BLOCK):
        mask = (k0 + offs < K) & (offs < GROUP)
        x = tl.load(x_ptr + row * stride_xm + k0 + offs, mask=mask, other=0.0).to(tl.float32)
        q = _round_to_e4m3(tl.minimum(tl.maximum(tl.div_rn(x, scale), -QUANT_MAX), QUANT_MAX))
        tl.store(q_ptr + row * stride_qm + k0 + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row * stride_sm + group, scale)


def _scale_layout(scale: torch.Tensor, block: tuple[int, int] | None) -> tuple[int, int, int]:
    """(output rows per scale row, input columns per scale column or 0, the scale's row stride)."""
    if block is None:
        return 1, 0, 1
    return block[0], block[1], scale.stride(0)


def fits(block: tuple[int, int] | None) -> bool:
    """Whether the kernels take this scale layout: per-row scales, or blocks whose columns fill whole K steps."""
    return block is None or block[1] % BLOCK_K == 0


def weight_only(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    block: tuple[int, int] | None,
    *,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int = 4,
    num_stages: int | None = None,
) -> torch.Tensor:
    """x [M, K] (a few rows, bf16/fp16) times the fp8 weight, activations unquantized."""
    if not fits(block):
        raise ValueError(f"fp8 blocks of {block[1]} columns: the Triton fp8 kernels need a multiple of {BLOCK_K}")
    m, k = x.shape
    n = weight.shape[0]
    rows_per_scale, cols_per_scale, scale_stride = _scale_layout(scale, block)
    launch = ONE_ROW_LAUNCH if m == 1 else FEW_ROWS_LAUNCH
    block_n, block_k = block_n or launch["block_n"], block_k or launch["block_k"]
    num_stages = num_stages or launch["num_stages"]
    if cols_per_scale and block_k % cols_per_scale and cols_per_scale % block_k:
        block_k = BLOCK_K  # a K tile holds whole blocks, or lies within one
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
        BLOCK_M=1 if m == 1 else max(16, triton.next_power_of_2(m)),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


def quantize(x: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn [M, K], float32 scales [M, groups]) with x ~ q x scale per row and group of `group` columns
    (None: the whole row, [M, 1]), each scale the group's amax / 448."""
    m, k = x.shape
    group = group or k
    groups = triton.cdiv(k, group)
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(m, groups, dtype=torch.float32, device=x.device)
    if m:
        block = min(2048, triton.next_power_of_2(group))
        _quantize_kernel[(m, groups)](
            x, q, scale, k, x.stride(0), q.stride(0), scale.stride(0), QUANT_MAX=E4M3_MAX, GROUP=group, BLOCK=block
        )
    return q, scale


def w8a8(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    block: tuple[int, int] | None,
    *,
    block_m: int = 64,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int = 4,
) -> torch.Tensor:
    """x [M, K] quantized per row and group of BLOCK_K columns, times the fp8 weight on fp8 tensor cores."""
    if not fits(block):
        raise ValueError(f"fp8 blocks of {block[1]} columns: the Triton fp8 kernels need a multiple of {BLOCK_K}")
    m, k = x.shape
    n = weight.shape[0]
    block_n = block_n or (64 if m <= 64 else 128)
    q, q_scale = quantize(x, BLOCK_K)
    rows_per_scale, cols_per_scale, scale_stride = _scale_layout(scale, block)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _w8a8_kernel[grid](
        q,
        q_scale,
        weight,
        scale,
        bias if bias is not None else scale,
        out,
        m,
        n,
        k,
        q.stride(0),
        q_scale.stride(0),
        weight.stride(0),
        scale_stride,
        out.stride(0),
        SCALE_ROWS=rows_per_scale,
        SCALE_COLS=cols_per_scale,
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=BLOCK_K,
        GROUP_M=8,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


# Rows up to which the weight-only kernel serves: beyond, fp8 tensor cores beat widening the weight.
WEIGHT_ONLY_MAX_ROWS = 16
# Launches measured fastest on an H100 over Llama-3-8B's four projections (bench/fp8_linear.py --sweep): the
# weight-only kernel at one row 0.367 ms for N 8 / K 2048 / 3 stages against 0.389 for N 8 / K 1024, at 4 to 16
# rows N 32 / K 256; the W8A8 GEMM 64 x 64 tiles up to 64 rows, 64 x 128 beyond (4 warps, 4 stages).
ONE_ROW_LAUNCH = dict(block_n=8, block_k=2048, num_stages=3)
FEW_ROWS_LAUNCH = dict(block_n=32, block_k=256, num_stages=4)


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    block: tuple[int, int] | None,
    prepared: Any = None,
) -> torch.Tensor:
    """The op table's `fp8_linear` (omnirun.layers.native_ops.fp8_linear's contract) in Triton alone."""
    if x.dtype not in (torch.bfloat16, torch.float16) or not fits(block):
        # float32 models, and blocks no published checkpoint has: the reference (correct, not fast)
        return native_ops.fp8_linear(x, weight, weight_scale, bias, block)
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if rows.shape[0] <= WEIGHT_ONLY_MAX_ROWS:
        out = weight_only(rows, weight, weight_scale, bias, block)
    else:
        out = w8a8(rows, weight, weight_scale, bias, block)
    return out.reshape(*x.shape[:-1], weight.shape[0])
