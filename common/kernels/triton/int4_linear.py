"""Linear layers on 4-bit weights kept packed (W4A16: AWQ and GPTQ checkpoints in the layout
omnirun.layers.linear.Int4Weights holds): the op table's `int4_linear` as one portable Triton kernel.

The weight is int32 [N, K / 8] (eight consecutive inputs a word, the lowest bits first), with float32 scales and
uint8 zero points [N, groups] over groups of GROUP consecutive inputs. Each program reads a [BLOCK_N, BLOCK_K / 8]
tile of words, unpacks the nibbles in registers, subtracts each group's zero point and multiplies by its scale in
float32, then:
- `gemv` (decode, one row): multiplies by x and reduces along K on the CUDA cores (BLOCK_M = 1); the layer costs its
  int4 bytes (a quarter of bf16's, plus a scale and zero point per group);
- `gemv` (2..16 rows) and `gemm` (many rows): rounds the tile to x's dtype and runs tensor-core dots on
  [BLOCK_M, BLOCK_K] x [BLOCK_K, BLOCK_N] tiles, accumulating in float32.
A tile's K step and the group size divide one another: a step inside one group loads one scale per row; a step
over several groups loads one per row and group.

Interpreter-safe: Triton's interpreter multiplies 16-bit floats' raw bits in tl.dot and truncates float32 ->
bfloat16 casts, so there the dots take float32 inputs (omnirun.kernels.triton.modes.INTERPRETED).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from omnirun.kernels.triton.modes import INTERPRETED
from omnirun.kernels.triton.tiles import l2_grouped_tile
from omnirun.layers import native_ops


@triton.jit
def _int4_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    z_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,  # scales' and zero points' row stride (both [N, groups], contiguous)
    stride_ym,
    GROUP: tl.constexpr,  # inputs per scale: a multiple of BLOCK_K, or a divisor of it
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid_m, pid_n = l2_grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    offs_w = tl.arange(0, BLOCK_K // 8)
    shifts = tl.arange(0, 8) * 4
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    s_rows = offs_n.to(tl.int64) * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        words = tl.load(
            w_rows + (k0 // 8 + offs_w)[None, :], mask=n_mask[:, None] & (k0 + offs_w * 8 < K)[None, :], other=0
        )  # [BN, BK / 8] int32
        q = (words[:, :, None] >> shifts[None, None, :]) & 0xF  # [BN, BK / 8, 8]: input 8c + j at [:, c, j]
        if GROUP % BLOCK_K == 0:  # the step lies inside one group
            g = k0 // GROUP
            s = tl.load(s_ptr + s_rows + g, mask=n_mask, other=0.0)
            z = tl.load(z_ptr + s_rows + g, mask=n_mask, other=0).to(tl.int32)
            w = (tl.reshape(q, (BLOCK_N, BLOCK_K)) - z[:, None]).to(tl.float32) * s[:, None]
        else:  # the step spans BLOCK_K // GROUP whole groups
            g = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
            g_mask = n_mask[:, None] & (g * GROUP < K)[None, :]
            s = tl.load(s_ptr + s_rows[:, None] + g[None, :], mask=g_mask, other=0.0)
            z = tl.load(z_ptr + s_rows[:, None] + g[None, :], mask=g_mask, other=0).to(tl.int32)
            q3 = tl.reshape(q, (BLOCK_N, BLOCK_K // GROUP, GROUP))
            w = tl.reshape((q3 - z[:, :, None]).to(tl.float32) * s[:, :, None], (BLOCK_N, BLOCK_K))
        kk = k0 + offs_k
        x = tl.load(x_rows + kk[None, :], mask=m_mask[:, None] & (kk < K)[None, :], other=0.0)  # [BM, BK]
        if BLOCK_M == 1:
            acc += tl.sum(x.to(tl.float32) * w, axis=1)[None, :]
        elif INTERPRETED:  # the interpreter's dot multiplies 16-bit floats' raw bits: give it float32
            acc += tl.dot(x.to(tl.float32), tl.trans(w))
        else:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _int4_planes_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    z_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_ym,
    GROUP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """The same product computed transposed, y^T = W x^T, one nibble plane at a time: plane j of a [BLOCK_N,
    BLOCK_K / 8] tile of words holds inputs 8c + j, so each plane is a [BLOCK_N, BLOCK_K / 8] weight tile as loaded
    (no reshape, no transpose) and the dot's left operand, against the x columns 8c + j (a strided [BLOCK_K / 8,
    BLOCK_M] load from cache)."""
    pid_m, pid_n = l2_grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    offs_c = tl.arange(0, BLOCK_K // 8)
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    s_rows = offs_n.to(tl.int64) * stride_sn
    x_cols = x_ptr + offs_m[None, :].to(tl.int64) * stride_xm
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        c = k0 // 8 + offs_c
        words = tl.load(w_rows + c[None, :], mask=n_mask[:, None] & (c * 8 < K)[None, :], other=0)  # [BN, BK / 8]
        if GROUP % BLOCK_K == 0:  # the step lies inside one group
            s = tl.load(s_ptr + s_rows + k0 // GROUP, mask=n_mask, other=0.0)[:, None]
            z = tl.load(z_ptr + s_rows + k0 // GROUP, mask=n_mask, other=0).to(tl.int32)[:, None]
        else:  # word c's group, per row
            g = s_rows[:, None] + (c * 8 // GROUP)[None, :]
            g_mask = n_mask[:, None] & (c * 8 < K)[None, :]
            s = tl.load(s_ptr + g, mask=g_mask, other=0.0)
            z = tl.load(z_ptr + g, mask=g_mask, other=0).to(tl.int32)
        for j in tl.static_range(8):
            w = (((words >> (4 * j)) & 0xF) - z).to(tl.float32) * s  # [BN, BK / 8]: inputs 8c + j
            kk = c * 8 + j
            if BLOCK_M == 1:
                xj = tl.load(x_ptr + pid_m * stride_xm + kk, mask=kk < K, other=0.0).to(tl.float32)
                acc += tl.sum(w * xj[None, :], axis=1)[:, None]
            else:
                xj = tl.load(x_cols + kk[:, None], mask=(kk < K)[:, None] & m_mask[None, :], other=0.0)
                if INTERPRETED:
                    acc += tl.dot(w, xj.to(tl.float32))
                else:
                    acc += tl.dot(w.to(xj.dtype), xj)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    y = y_ptr + offs_m[None, :].to(tl.int64) * stride_ym + offs_n[:, None]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=n_mask[:, None] & m_mask[None, :])


def fits(group_size: int, block_k: int) -> bool:
    """Whether a K step of `block_k` and the group size divide one another (the kernel's one constraint)."""
    return group_size % block_k == 0 or (block_k % group_size == 0 and group_size % 8 == 0)


def _launch(
    x: torch.Tensor,
    weight_packed: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    bias: torch.Tensor | None,
    group_size: int,
    *,
    block_m: int,
    block_n: int,
    block_k: int,
    num_warps: int,
    num_stages: int,
    planes: bool = False,
) -> torch.Tensor:
    m, k = x.shape
    n = weight_packed.shape[0]
    if not fits(group_size, block_k):
        raise ValueError(f"int4 groups of {group_size} and a K step of {block_k}: neither divides the other")
    if scale.stride() != zero_point.stride() or scale.stride(1) != 1:
        raise ValueError("int4 scales and zero points must be contiguous [N, groups] alike")
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    (_int4_planes_kernel if planes else _int4_kernel)[grid](
        x,
        weight_packed,
        scale,
        zero_point,
        bias if bias is not None else scale,
        out,
        m,
        n,
        k,
        x.stride(0),
        weight_packed.stride(0),
        scale.stride(0),
        out.stride(0),
        GROUP=group_size,
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        GROUP_M=8,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


# Tiles measured best for the fp8 weight-only kernel on an H200 (long K tiles at one row: short ones left it 3x
# slower than bf16); a starting point for int4 until bench/int4_linear.py --sweep has run on a GPU.
ONE_ROW_LAUNCH = dict(block_n=8, block_k=1024)
FEW_ROWS_LAUNCH = dict(block_n=32, block_k=256)


def k_step(group_size: int, preferred: int) -> int:
    """The longest K step up to `preferred` (halving down to 64) that the group size fits; ValueError if none."""
    step = preferred
    while step >= 64:
        if fits(group_size, step):
            return step
        step //= 2
    raise ValueError(f"int4 groups of {group_size}: no K step of 64 or more fits them")


def gemv(
    x: torch.Tensor,
    weight_packed: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    bias: torch.Tensor | None,
    group_size: int,
    *,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int = 4,
    num_stages: int = 4,
    planes: bool = False,
) -> torch.Tensor:
    """x [M, K] (M <= 16, bf16/fp16) times the 4-bit weight: one row on the CUDA cores, more on 16-row dots."""
    block_m = 1 if x.shape[0] == 1 else 16
    launch = ONE_ROW_LAUNCH if block_m == 1 else FEW_ROWS_LAUNCH
    return _launch(
        x,
        weight_packed,
        scale,
        zero_point,
        bias,
        group_size,
        block_m=block_m,
        block_n=block_n or launch["block_n"],
        block_k=block_k or k_step(group_size, launch["block_k"]),
        num_warps=num_warps,
        num_stages=num_stages,
        planes=planes,
    )


def gemm(
    x: torch.Tensor,
    weight_packed: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    bias: torch.Tensor | None,
    group_size: int,
    *,
    block_m: int = 64,
    block_n: int = 128,
    block_k: int | None = None,
    num_warps: int = 4,
    num_stages: int = 3,
    planes: bool = False,
) -> torch.Tensor:
    """x [M, K] (many rows, bf16/fp16) times the 4-bit weight, each tile dequantized to x's dtype for the dots."""
    block_k = block_k or k_step(group_size, 64)
    return _launch(
        x,
        weight_packed,
        scale,
        zero_point,
        bias,
        group_size,
        block_m=block_m,
        block_n=block_n,
        block_k=block_k,
        num_warps=num_warps,
        num_stages=num_stages,
        planes=planes,
    )


def takes(out_features: int, in_features: int, group_size: int, dtype: torch.dtype) -> bool:
    """`int4_linear_takes`: bf16/fp16 models with groups a K step fits (float32 models and odd groups dequantize at
    load rather than run the reference below)."""
    return dtype in (torch.bfloat16, torch.float16) and fits(group_size, 64)


# Rows up to which the GEMV tiles serve: above, 64-row tiles read each weight tile for more rows.
GEMV_MAX_ROWS = 16


def int4_linear(
    x: torch.Tensor,
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_zero_point: torch.Tensor,
    bias: torch.Tensor | None,
    group_size: int,
    prepared: Any = None,
) -> torch.Tensor:
    """The op table's `int4_linear` (omnirun.layers.native_ops.int4_linear's contract) in Triton alone."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if x.dtype not in (torch.bfloat16, torch.float16) or not fits(group_size, 64) or rows.shape[0] == 0:
        # float32 models, and groups no published checkpoint has (e.g. 96): the reference, correct but not fast
        return native_ops.int4_linear(x, weight_packed, weight_scale, weight_zero_point, bias, group_size)
    kernel = gemv if rows.shape[0] <= GEMV_MAX_ROWS else gemm
    out = kernel(rows, weight_packed, weight_scale, weight_zero_point, bias, group_size)
    return out.reshape(*x.shape[:-1], weight_packed.shape[0])
