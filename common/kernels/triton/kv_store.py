"""Store a step's new K and V into the paged KV cache with one Triton launch per layer.

`PagedKVCache.set_kv` takes a cast and an indexed store for each of K and V (plus a copy when V is a strided view of
the fused qkv output); this kernel reads both rows of a token once and writes them, cast, to its slot.
`rotate_and_store_kv` also applies the rotary embedding on the way (q in place, k into the cache): one launch
where rotary + store took two.

Casts give the bits torch's `.to(cache dtype)` gives. fp8 (e4m3fn, e5m2) stores value / the layer's scale (the
division rounded to nearest, as torch's float32 division in `PagedKVCache.set_kv`), rounded in software the way
torch 2.13's conversion does it: round to nearest even; e4m3fn saturates finite overflow and inf to +-448 (torch
2.11 still made NaN of them), e5m2 overflows to +-inf; NaN stays NaN. Triton's own cast agrees in range (every bf16,
fp16 value checked on an H200) but saturates e5m2 at 57344, and the interpreter's does not round to nearest even;
writing bytes also needs no fp8 type in Triton's target. The fnuz flavours are not handled: `supports` says no.

Graph-safe: no host sync and no data-dependent allocation (the slots are read on the device, never checked).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from omnirun.kernels.triton.ops import (
    BIT_EXACT_LAUNCH,
    rope_kernel_takes,
    rope_launch,
    rope_program,
    rotate_heads_in_place,
    rotated_heads,
    round_to,
)
from omnirun.kernels.triton.pdl import launch_options, wait_for_previous_kernel

# What the kernel does to a value before storing it (a constexpr: one compiled variant per cache dtype).
_CAST, _E4M3_BITS, _E5M2_BITS = 0, 1, 2
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)  # K/V dtypes, and the cache dtypes cast plainly
_FP8_KINDS = {torch.float8_e4m3fn: _E4M3_BITS, torch.float8_e5m2: _E5M2_BITS}


@triton.jit
def _f32(x):
    """`x` widened to float32; bfloat16 by moving its bits (exact for subnormals too, unlike the interpreter)."""
    if x.dtype == tl.bfloat16:
        y = (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        y = x.to(tl.float32)
    return y


@triton.jit
def _fp8_bits(x, E4M3: tl.constexpr):
    """float32 -> fp8 bits (uint8) as torch's fp8e4m3fn/fp8e5m2_from_fp32_value compute them.

    On the magnitude's bits (int32, sign cleared): values below the smallest normal are rounded by one float add
    that lines their bits up with the fp8 subnormal grid; normal values get the exponent rebiased and a
    round-half-to-even bias added before the mantissa is cut; beyond the range comes the overflow pattern."""
    bits = x.to(tl.int32, bitcast=True)
    sign = tl.where(bits < 0, 0x80, 0)
    mag = bits & 0x7FFFFFFF
    if E4M3:
        # 2^-6: smallest normal; 2^14 (141 << 23): the magic number whose ulp is the 2^-9 subnormal step;
        # 480 (1087 << 20): the first value that does not round to 448.
        sub = (mag.to(tl.float32, bitcast=True) + 16384.0).to(tl.int32, bitcast=True) - (141 << 23)
        norm = (mag - (120 << 23) + 0x7FFFF + ((mag >> 20) & 1)) >> 20
        norm = tl.minimum(norm, 0x7E)  # a rounding carry into 0x7F (NaN) saturates to 448
        out = tl.where(mag < (121 << 23), sub, norm)
        out = tl.where(mag >= (1087 << 20), tl.where(mag > 0x7F800000, 0x7F, 0x7E), out)
    else:
        # 2^-14: smallest normal; 2^7 (134 << 23): ulp 2^-16, the subnormal step; 2^16 (143 << 23): beyond range.
        sub = (mag.to(tl.float32, bitcast=True) + 128.0).to(tl.int32, bitcast=True) - (134 << 23)
        norm = (mag - (112 << 23) + 0xFFFFF + ((mag >> 21) & 1)) >> 21  # a carry past 57344 lands on inf
        out = tl.where(mag < (113 << 23), sub, norm)
        out = tl.where(mag >= (143 << 23), tl.where(mag > 0x7F800000, 0x7F, 0x7C), out)
    return (out | sign).to(tl.uint8)


@triton.jit
def _scaled(x, scale):
    """float32 x / scale rounded to nearest; NaN as it is (the GPU's division makes every NaN the positive one, and
    torch's cast keeps the sign)."""
    f = _f32(x)
    return tl.where(f == f, tl.math.div_rn(f, scale), f)


@triton.jit
def _cast(x, dtype: tl.constexpr, KIND: tl.constexpr, scale):
    """`x` as the cache stores it: fp8 bits of x / scale, or x cast to `dtype` (unscaled caches)."""
    if KIND == 1:  # _E4M3_BITS
        y = _fp8_bits(_scaled(x, scale), True)
    elif KIND == 2:  # _E5M2_BITS
        y = _fp8_bits(_scaled(x, scale), False)
    elif x.dtype == dtype:
        y = x
    else:
        y = round_to(_f32(x), dtype)
    return y


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slots_ptr,
    k_stride,
    v_stride,
    width,
    k_scale,
    v_scale,
    KIND: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Program (token, chunk): one chunk of the token's K row and of its V row, to row `slots[token]`."""
    wait_for_previous_kernel(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < width
    dst = tl.load(slots_ptr + token).to(tl.int64) * width + offs
    out_ty = k_cache_ptr.dtype.element_ty
    k = tl.load(k_ptr + token * k_stride + offs, mask=mask)
    tl.store(k_cache_ptr + dst, _cast(k, out_ty, KIND, k_scale), mask=mask)
    v = tl.load(v_ptr + token * v_stride + offs, mask=mask)
    tl.store(v_cache_ptr + dst, _cast(v, out_ty, KIND, v_scale), mask=mask)


def supports(cache_dtype: torch.dtype, input_dtype: torch.dtype) -> bool:
    """Whether `store_kv` handles this cache dtype and K/V dtype (else use `PagedKVCache.set_kv`)."""
    return input_dtype in _FLOATS and (cache_dtype in _FLOATS or cache_dtype in _FP8_KINDS)


def _kind(cache_dtype: torch.dtype) -> int:
    return _FP8_KINDS.get(cache_dtype, _CAST)


def _rows(t: torch.Tensor, width: int) -> torch.Tensor:
    """`t` as [n, width] with a contiguous last dimension: a view for the layouts layers pass, else a copy."""
    t = t.reshape(t.shape[0], width)
    return t if t.stride(1) == 1 else t.contiguous()


def _check_store(
    k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k and v caches differ: {tuple(k_cache.shape)} {k_cache.dtype}, {v_cache.dtype}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the KV caches must be contiguous")
    if not supports(k_cache.dtype, k.dtype) or v.dtype != k.dtype:
        raise ValueError(f"cannot store {k.dtype}/{v.dtype} into a {k_cache.dtype} cache")
    n, width = k.shape[0], k_cache.shape[1:].numel()
    if slots.dtype not in (torch.int32, torch.int64) or slots.device != k_cache.device:
        raise ValueError(f"slots must be int32/int64 on {k_cache.device}, got {slots.dtype} on {slots.device}")
    if k.numel() != n * width or v.shape[0] != n or v.numel() != n * width or slots.shape != (n,):
        raise ValueError(
            f"k, v must be [n, {width}] (or [n, kv_heads, head_dim]) with n slots; got {tuple(k.shape)}, "
            f"{tuple(v.shape)}, slots {tuple(slots.shape)}"
        )


def _cache_bytes(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(cast kind, the caches as the kernels write them: fp8 ones as their bytes)."""
    kind = _kind(k_cache.dtype)
    if kind in (_E4M3_BITS, _E5M2_BITS):
        return kind, k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    return kind, k_cache, v_cache


def store_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scales: tuple[float, float] = (1.0, 1.0),
    pdl: bool = False,
) -> None:
    """Write k, v ([n, kv_heads*head_dim] or [n, kv_heads, head_dim]; rows may be strided) into rows `slots`
    ([n], any integer dtype, unique unless the rows written are equal) of the caches ([num_slots, kv_heads,
    head_dim], contiguous), cast to the cache dtype (fp8: k / scales[0] and v / scales[1])."""
    _check_store(k_cache, v_cache, slots, k, v)
    n, width = k.shape[0], k_cache.shape[1:].numel()
    if n == 0:
        return
    kind, k_cache, v_cache = _cache_bytes(k_cache, v_cache)
    k, v = _rows(k, width), _rows(v, width)
    block = min(triton.next_power_of_2(width), 4096)
    _store_kv_kernel[(n, triton.cdiv(width, block))](
        k,
        v,
        k_cache,
        v_cache,
        slots,
        k.stride(0),
        v.stride(0),
        width,
        *scales,
        KIND=kind,
        BLOCK=block,
        USE_PDL=pdl,
        num_warps=max(1, min(8, block // 256)),
        **launch_options(pdl),
    )


@triton.jit
def _rotate_and_store_kv_kernel(
    positions_ptr,
    cos_sin_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slots_ptr,
    cos_sin_stride,
    q_stride,
    k_stride,
    v_stride,
    q_heads,
    kv_heads,
    k_scale,
    v_scale,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    KIND: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Program (token, chunk of heads): rotates the chunk's q heads in place, and writes its k heads rotated and
    its v heads as they are to row `slots[token]` of the caches, cast."""
    # Positions, the cos|sin table and the slots are written before the step, never by the kernel just before this
    # one (the q|k|v projection): under PDL their loads go ahead of the wait, off the chain of dependent loads.
    token, first_head, d, d_mask, cos, sin = rope_program(
        positions_ptr, cos_sin_ptr, cos_sin_stride, q_ptr.dtype.element_ty, HALF, BLOCK_HALF, BLOCK_HEADS
    )
    slot = tl.load(slots_ptr + token).to(tl.int64)
    wait_for_previous_kernel(USE_PDL)
    rotate_heads_in_place(q_ptr + token * q_stride, q_heads, first_head, cos, sin, d, d_mask, HALF, BLOCK_HEADS)
    k1, k2, in_row, mask = rotated_heads(
        k_ptr + token * k_stride, kv_heads, first_head, cos, sin, d, d_mask, HALF, BLOCK_HEADS
    )
    dst = slot * (kv_heads * 2 * HALF) + in_row
    out_ty = k_cache_ptr.dtype.element_ty
    tl.store(k_cache_ptr + dst, _cast(k1, out_ty, KIND, k_scale), mask=mask)
    tl.store(k_cache_ptr + dst + HALF, _cast(k2, out_ty, KIND, k_scale), mask=mask)
    v_row = v_ptr + token * v_stride + in_row
    tl.store(v_cache_ptr + dst, _cast(tl.load(v_row, mask=mask), out_ty, KIND, v_scale), mask=mask)
    tl.store(v_cache_ptr + dst + HALF, _cast(tl.load(v_row + HALF, mask=mask), out_ty, KIND, v_scale), mask=mask)


def fuses_rotary(
    k_cache: torch.Tensor,
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_dim: int,
) -> bool:
    """Whether `rotate_and_store_kv` takes these inputs: what the rotary kernel and the store kernel both take,
    with k and v as [n, kv_heads * head_dim] rows of the cache's width."""
    return (
        rope_kernel_takes(positions, q, k, cos_sin_cache, head_dim)
        and supports(k_cache.dtype, k.dtype)
        and v.dtype == k.dtype
        and v.dim() == 2
        and v.stride(-1) == 1
        and k_cache.dim() == 3
        and k_cache.shape[2] == head_dim
        and k.shape[1] == v.shape[1] == k_cache.shape[1] * head_dim
        and q.shape[1] % head_dim == 0
    )


def rotate_and_store_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_dim: int,
    *,
    scales: tuple[float, float] = (1.0, 1.0),
    pdl: bool = False,
) -> None:
    """`ops.rotary_embedding(positions, q, k, ...)` then `store_kv(k_cache, v_cache, slots, k, v, scales=scales)` in
    one launch, with the same bits, except that k itself is left unrotated (only its cached copy is): q [n,
    heads*head_dim] is rotated in place, k and v ([n, kv_heads*head_dim], rows may be strided views of the qkv
    output) land in rows `slots` of the caches. Callers check `fuses_rotary` first."""
    _check_store(k_cache, v_cache, slots, k, v)
    if not fuses_rotary(k_cache, positions, q, k, v, cos_sin_cache, head_dim):
        raise ValueError("rotate_and_store_kv: inputs the kernel does not take (check fuses_rotary first)")
    tokens = q.shape[0]
    if tokens == 0:
        return
    kind, k_cache, v_cache = _cache_bytes(k_cache, v_cache)
    q_heads, kv_heads = q.shape[1] // head_dim, k.shape[1] // head_dim
    half, block_half, block_heads, num_warps = rope_launch(head_dim, max(q_heads, kv_heads))
    _rotate_and_store_kv_kernel[(tokens, triton.cdiv(max(q_heads, kv_heads), block_heads))](
        positions,
        cos_sin_cache,
        q,
        k,
        v,
        k_cache,
        v_cache,
        slots,
        cos_sin_cache.stride(0),
        q.stride(0),
        k.stride(0),
        v.stride(0),
        q_heads,
        kv_heads,
        *scales,
        HALF=half,
        BLOCK_HALF=block_half,
        BLOCK_HEADS=block_heads,
        KIND=kind,
        USE_PDL=pdl,
        num_warps=num_warps,
        **BIT_EXACT_LAUNCH,
        **launch_options(pdl),
    )
