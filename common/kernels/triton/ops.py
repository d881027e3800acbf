"""Triton kernels for the fused ops: rmsnorm (with the residual add), rotary embedding, silu-and-mul.

Each follows its torch-native reference in `native_ops` step for step (float32 where the reference computes in
float32, a rounding to the activation dtype wherever the reference rounds), so bf16 results agree bit for bit
except where the reference's own float32 reduction order decides a rounding. They are memory-bound: each reads its
inputs once and writes its outputs once.

Importing this module imports triton; only a platform whose capabilities say `supports_triton` imports it.
Inputs are [rows, features] tensors whose last dimension is contiguous (rows may be strided); other layouts and
dtypes the kernels do not handle go through the references.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from omnirun.kernels.triton.modes import BIT_EXACT_LAUNCH, INTERPRETED
from omnirun.kernels.triton.pdl import launch_options, wait_for_previous_kernel
from omnirun.layers import native_ops

_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """float32 `x` rounded to nearest-even in `dtype` (the rounding torch applies when it stores a result)."""
    if INTERPRETED and dtype == tl.bfloat16:
        # The interpreter's cast truncates: round by hand (NaN -> torch's 0x7FC0, not a carry into the sign).
        bits = x.to(tl.uint32, bitcast=True)
        bits = tl.where(x != x, 0x7FC00000, bits + 0x7FFF + ((bits >> 16) & 1))
        y = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        y = x.to(dtype)
    return y


@triton.jit
def _exp(x):
    """exp as torch's GPU kernels compute it (the vendor math library, not triton's faster approximation)."""
    if INTERPRETED:
        y = tl.exp(x)
    else:
        y = libdevice.exp(x)
    return y


@triton.jit
def _rsqrt(x):
    """rsqrt as torch's GPU kernels compute it (the vendor math library's rsqrtf)."""
    if INTERPRETED:
        y = tl.math.rsqrt(x)
    else:
        y = libdevice.rsqrt(x)
    return y


def _num_warps(elements: int) -> int:
    """Warps for a program touching `elements` values: enough threads to keep loads vectorised, few registers each."""
    if elements <= 2048:
        return 4
    if elements <= 8192:
        return 8
    return 16


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """`t` as [rows, features] with a contiguous last dimension: a view where possible, else a contiguous copy."""
    if t.dim() == 2 and t.stride(-1) == 1 and t.stride(0) >= t.shape[1]:
        return t
    return t.contiguous().view(-1, t.shape[-1])


# --- rmsnorm ---------------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["rows"])  # the batch size changes every step: one compiled kernel for all
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    summed_ptr,
    rows,
    n,
    x_stride,
    residual_stride,
    out_stride,
    summed_stride,
    inv_n,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    col = tl.arange(0, BLOCK)[None, :]
    # No kernel writes the weight: under PDL it loads before the wait, off the chain of loads after it (there it
    # would come after the reduction, one more round trip per norm).
    weight = tl.load(weight_ptr + col, mask=col < n, other=0.0)
    wait_for_previous_kernel(USE_PDL)
    row = (tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)[:, None]
    mask = (row < rows) & (col < n)
    x = tl.load(x_ptr + row * x_stride + col, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * residual_stride + col, mask=mask, other=0.0)
        x = round_to(x.to(tl.float32) + residual.to(tl.float32), summed_ptr.dtype.element_ty)
        tl.store(summed_ptr + row * summed_stride + col, x, mask=mask)
    x32 = x.to(tl.float32)
    # mean as torch's GPU reduction takes it: the sum times 1/n (padding lanes add zeros).
    mean_square = tl.sum(x32 * x32, axis=1) * inv_n
    normed = round_to(x32 * _rsqrt(mean_square + eps)[:, None], x.dtype)
    out = round_to(normed.to(tl.float32) * weight.to(tl.float32), out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * out_stride + col, out, mask=mask)


def _launch_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    out: torch.Tensor,
    summed: torch.Tensor | None,
    eps: float,
    pdl: bool,
) -> None:
    rows, n = x.shape
    if rows == 0:
        return
    block = triton.next_power_of_2(n)
    # Short rows (per-head q/k norms) are packed several to a program so each program still moves ~2K values.
    block_rows = max(1, 2048 // block)
    has_residual = residual is not None
    _rms_norm_kernel[(triton.cdiv(rows, block_rows),)](
        x,
        residual if has_residual else x,
        weight,
        out,
        summed if has_residual else out,
        rows,
        n,
        x.stride(0),
        residual.stride(0) if has_residual else 0,
        out.stride(0),
        summed.stride(0) if has_residual else 0,
        1.0 / n,
        eps,
        HAS_RESIDUAL=has_residual,
        BLOCK_ROWS=block_rows,
        BLOCK=block,
        USE_PDL=pdl,
        num_warps=_num_warps(block_rows * block),
        **BIT_EXACT_LAUNCH,
        **launch_options(pdl),
    )


def _kernel_can_norm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return x.dtype in _KERNEL_DTYPES and weight.dtype in _KERNEL_DTYPES and weight.is_contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, pdl: bool = False) -> torch.Tensor:
    """weight * x / rms(x) over the last dimension: the statistic in float32, the normalised value rounded to x's
    dtype, then multiplied by the weight (in the dtype torch promotes x and weight to), as `native_ops.rms_norm`."""
    if not _kernel_can_norm(x, weight):
        return native_ops.rms_norm(x, weight, eps)
    rows = _as_rows(x)
    out = torch.empty(rows.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    _launch_rms_norm(rows, None, weight, out, None, eps, pdl)
    return out.view(x.shape)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *, pdl: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) in one pass, the sum rounded to the dtype as the reference does.

    In place: the sum is written into `residual`'s memory and the normalised output into `x`'s (callers never
    reuse either input), so the returned tensors are `x` and `residual` themselves where their dtype and layout
    allow; otherwise new tensors.
    """
    if not _kernel_can_norm(x, weight) or residual.dtype != x.dtype or residual.shape != x.shape:
        return native_ops.add_rms_norm(x, residual, weight, eps)
    x_rows, residual_rows = _as_rows(x), _as_rows(residual)
    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    # Each program reads its rows whole before writing them, so writing over the inputs is safe; but `x` and
    # `residual` being one tensor would make both outputs land in the same memory.
    distinct = x_rows.data_ptr() != residual_rows.data_ptr()
    out = x_rows if out_dtype == x.dtype and distinct else torch.empty(x_rows.shape, dtype=out_dtype, device=x.device)
    _launch_rms_norm(x_rows, residual_rows, weight, out, residual_rows, eps, pdl)
    return out.view(x.shape), residual_rows.view(x.shape)


# --- silu and mul ----------------------------------------------------------------------------------------------


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, d, x_stride, out_stride, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    wait_for_previous_kernel(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = col < d
    gate = tl.load(x_ptr + row * x_stride + col, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + d + col, mask=mask, other=0.0)
    # silu in float32 as torch's kernel (x / (1 + exp(-x)), IEEE division), rounded; then the product, rounded.
    act = round_to(tl.math.div_rn(gate, 1.0 + _exp(-gate)), up.dtype)
    out = round_to(act.to(tl.float32) * up.to(tl.float32), out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * out_stride + col, out, mask=mask)


def silu_and_mul(x: torch.Tensor, *, pdl: bool = False) -> torch.Tensor:
    """silu(gate) * up for x = [gate | up] along the last dimension, as `native_ops.silu_and_mul`."""
    if x.dtype not in _KERNEL_DTYPES or x.shape[-1] % 2:
        return native_ops.silu_and_mul(x)
    rows = _as_rows(x)
    tokens, d = rows.shape[0], rows.shape[1] // 2
    out = torch.empty((tokens, d), dtype=x.dtype, device=x.device)
    if tokens and d:
        # Column tiles keep a program's registers bounded for wide MLPs (d = 14336 and more).
        block = min(triton.next_power_of_2(d), 2048)
        _silu_and_mul_kernel[(tokens, triton.cdiv(d, block))](
            rows,
            out,
            d,
            rows.stride(0),
            out.stride(0),
            BLOCK=block,
            USE_PDL=pdl,
            num_warps=_num_warps(block),
            **BIT_EXACT_LAUNCH,
            **launch_options(pdl),
        )
    return out.view(*x.shape[:-1], d)


# --- rotary embedding ------------------------------------------------------------------------------------------


@triton.jit
def rope_program(
    positions_ptr,
    cos_sin_ptr,
    cos_sin_stride,
    dtype: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
):
    """What a rotary program of grid (token, chunk of heads) works with: (token, first head, half-dim lanes d and
    their mask, cos, sin). cos and sin ([1, BLOCK_HALF] float32) come from the token's row of the float32 cos|sin
    table, rounded to the activation dtype first, as the reference casts the table before rotating."""
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)[None, :]
    d_mask = d < HALF
    row_ptr = cos_sin_ptr + position * cos_sin_stride
    cos = round_to(tl.load(row_ptr + d, mask=d_mask, other=0.0), dtype).to(tl.float32)
    sin = round_to(tl.load(row_ptr + HALF + d, mask=d_mask, other=0.0), dtype).to(tl.float32)
    return token, tl.program_id(1) * BLOCK_HEADS, d, d_mask, cos, sin


@triton.jit
def rotated_heads(row_ptr, heads, first_head, cos, sin, d, d_mask, HALF: tl.constexpr, BLOCK_HEADS: tl.constexpr):
    """Heads [first_head, first_head + BLOCK_HEADS) of one token's row (masked past `heads`), NeoX-rotated:
    x*cos + rotate_half(x)*sin with rotate_half(x) = [-x2 | x1], each product rounded to the row's dtype, then the
    sum, as the reference rounds. Returns (first halves, second halves, their offsets in the row, mask)."""
    dtype = row_ptr.dtype.element_ty
    offsets = (first_head + tl.arange(0, BLOCK_HEADS)[:, None]) * (2 * HALF) + d
    mask = (first_head + tl.arange(0, BLOCK_HEADS)[:, None] < heads) & d_mask
    x1 = tl.load(row_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(row_ptr + offsets + HALF, mask=mask, other=0.0).to(tl.float32)
    out1 = round_to(round_to(x1 * cos, dtype).to(tl.float32) - round_to(x2 * sin, dtype).to(tl.float32), dtype)
    out2 = round_to(round_to(x2 * cos, dtype).to(tl.float32) + round_to(x1 * sin, dtype).to(tl.float32), dtype)
    return out1, out2, offsets, mask


@triton.jit
def rotate_heads_in_place(
    row_ptr, heads, first_head, cos, sin, d, d_mask, HALF: tl.constexpr, BLOCK_HEADS: tl.constexpr
):
    out1, out2, offsets, mask = rotated_heads(row_ptr, heads, first_head, cos, sin, d, d_mask, HALF, BLOCK_HEADS)
    tl.store(row_ptr + offsets, out1, mask=mask)
    tl.store(row_ptr + offsets + HALF, out2, mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr,
    q_ptr,
    k_ptr,
    cache_ptr,
    q_stride,
    k_stride,
    cache_stride,
    q_heads,
    k_heads,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # One program per (token, chunk of heads): the chunk's q heads and its k heads (masked past their counts).
    wait_for_previous_kernel(USE_PDL)
    token, first_head, d, d_mask, cos, sin = rope_program(
        positions_ptr, cache_ptr, cache_stride, q_ptr.dtype.element_ty, HALF, BLOCK_HALF, BLOCK_HEADS
    )
    rotate_heads_in_place(q_ptr + token * q_stride, q_heads, first_head, cos, sin, d, d_mask, HALF, BLOCK_HEADS)
    rotate_heads_in_place(k_ptr + token * k_stride, k_heads, first_head, cos, sin, d, d_mask, HALF, BLOCK_HEADS)


def rope_launch(head_dim: int, heads: int) -> tuple[int, int, int, int]:
    """(half, block_half, block_heads, num_warps) of a rotary launch over `heads` heads a token: chunks of up to
    ~2K values a program, bounded registers and more programs for small batches."""
    half = head_dim // 2
    block_half = triton.next_power_of_2(half)
    block_heads = max(1, min(triton.next_power_of_2(heads), 2048 // block_half))
    return half, block_half, block_heads, _num_warps(block_heads * block_half)


def rope_kernel_takes(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor, head_dim: int
) -> bool:
    """Whether the rotary kernels take these inputs (else the reference rotates them)."""
    return (
        positions.dim() == 1
        and positions.is_contiguous()
        and q.dtype in _KERNEL_DTYPES
        and k.dtype == q.dtype
        and q.dim() == 2
        and k.dim() == 2
        and q.stride(-1) == 1
        and k.stride(-1) == 1
        and cos_sin_cache.stride(-1) == 1
        and head_dim % 2 == 0
    )


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_dim: int,
    *,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [tokens, heads*head_dim] and k [tokens, kv_heads*head_dim] by their positions (NeoX layout),
    in place, and return them, with the roundings of `native_ops.rotary_embedding`.

    q and k may be row views of a fused qkv output (row stride larger than the row; last dimension contiguous).
    `cos_sin_cache` is float32 [max_positions, head_dim] (cos of the head_dim/2 frequencies, then their sin);
    every position must be below max_positions (not checked: that would cost a device sync).
    """
    if not rope_kernel_takes(positions, q, k, cos_sin_cache, head_dim):
        rotated_q, rotated_k = native_ops.rotary_embedding(positions, q, k, cos_sin_cache, head_dim)
        q.copy_(rotated_q.view(q.shape))
        k.copy_(rotated_k.view(k.shape))
        return q, k
    tokens = q.shape[0]
    if tokens == 0:
        return q, k
    q_heads, k_heads = q.shape[1] // head_dim, k.shape[1] // head_dim
    half, block_half, block_heads, num_warps = rope_launch(head_dim, max(q_heads, k_heads))
    _rotary_kernel[(tokens, triton.cdiv(max(q_heads, k_heads), block_heads))](
        positions,
        q,
        k,
        cos_sin_cache,
        q.stride(0),
        k.stride(0),
        cos_sin_cache.stride(0),
        q_heads,
        k_heads,
        HALF=half,
        BLOCK_HALF=block_half,
        BLOCK_HEADS=block_heads,
        USE_PDL=pdl,
        num_warps=num_warps,
        **BIT_EXACT_LAUNCH,
        **launch_options(pdl),
    )
    return q, k


def triton_fused_ops(
    pdl: bool = False, device_name: str | None = None, fp8_e4m3_dtype: torch.dtype | None = None
) -> dict[str, Callable[..., Any]]:
    """The op table entries these kernels provide, for a platform's `fused_ops()`; `pdl`: launched with
    programmatic dependent launch (`omnirun.kernels.triton.pdl`), for platforms that have it; `device_name`: whose
    launch tables to read (omnirun.kernels.triton.moe_tiles); `fp8_e4m3_dtype`: the device's fp8 (Capabilities),
    None where it has none.

    Experts kept in fp8 (`fp8_fused_moe`) wherever the device has fp8: the kernels widen each tile in registers, a
    conversion Triton compiles on NVIDIA GPUs from sm89 (those whose capabilities say fp8), on AMD GPUs with fp8 and on
    Intel GPUs (in software there: intel-xpu-backend-for-triton's XPUOptions lists fp8e4nv; convert_custom_float8).
    An e4m3fnuz device (an MI300) reads the e4m3fn bits as fnuz, the encoding it converts natively, with the scales
    doubled: the same values (moe.py::_fnuz)."""
    ops = {
        "rms_norm": rms_norm,
        "add_rms_norm": add_rms_norm,
        "silu_and_mul": silu_and_mul,
        "rotary_embedding": rotary_embedding,
    }
    if pdl:
        ops = {name: functools.partial(op, pdl=True) for name, op in ops.items()}
    from omnirun.kernels.triton import int4_linear  # W4A16 (AWQ, GPTQ): integer unpacking, 16-bit dots
    from omnirun.kernels.triton.matmul import batch_invariant_linear  # deterministic mode's linear layers
    from omnirun.kernels.triton.moe import fp8_fused_moe, fused_moe, int4_fused_moe  # graph-capturable
    from omnirun.kernels.triton.moe_tiles import tiles_for
    from omnirun.kernels.triton.penalties import apply_penalties  # the penalties in one pass over the logits
    from omnirun.kernels.triton.sample import sample  # sort-free sampling (bench/sample_op.py measures it)
    from omnirun.kernels.triton.token_bitmask import apply_token_bitmask  # a grammar's mask in one pass

    tiles = tiles_for(device_name)
    if fp8_e4m3_dtype is not None:
        fnuz = fp8_e4m3_dtype == torch.float8_e4m3fnuz
        ops["fp8_fused_moe"] = functools.partial(fp8_fused_moe, tiles=tiles, fnuz=fnuz)
    return {
        **ops,
        "batch_invariant_linear": batch_invariant_linear,
        "sample": sample,
        "apply_penalties": apply_penalties,
        "apply_token_bitmask": apply_token_bitmask,
        "fused_moe": functools.partial(fused_moe, tiles=tiles),
        "int4_fused_moe": functools.partial(int4_fused_moe, tiles=tiles),
        "int4_linear": int4_linear.int4_linear,
        "int4_linear_takes": int4_linear.takes,
    }
