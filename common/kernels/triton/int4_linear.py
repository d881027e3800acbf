"""Linear layers on 4-bit weights kept packed (W4A16: AWQ and GPTQ checkpoints in the layout
omnirun.layers.linear.Int4Weights holds): the op table's `int4_linear` in Triton.

The weight is int32 [N, K / 8] (eight consecutive inputs a word, the lowest bits first), with float32 scales and
uint8 zero points [N, groups] over groups of GROUP consecutive inputs. By rows of x:
- up to GEMV_MAX_ROWS rows (decode, `gemv`): each program reads [BLOCK_N, BLOCK_K / 8] words a step for one or
  two rows of x; each thread multiplies the nibbles of the words it holds by each row on the CUDA cores and keeps
  the sums apart until the last step (sm90 SASS without the JIT's divisibility hints: 5.2 instructions a weight at
  one row, against 10.4 where each step reduced along K across threads; with them 4.3 at one row and 6.1 at two,
  the nibbles unpacked once for both);
- up to DEQUANTIZE_MIN_ROWS (`gemm`): tensor-core dots on [BLOCK_M, BLOCK_K] x [BLOCK_K, BLOCK_N] tiles, the weight
  tile unpacked once per BLOCK_M rows; a few rows make few output tiles, so K is split over programs too, each
  writing a float32 partial sum that one sum adds up (deterministic, no atomics);
- more (prefill, large batches; `dequantized_linear`): the weight dequantized whole into a scratch of x's dtype, then
  the device's own matmul.

The nibbles become numbers without a conversion instruction (int -> float conversions issue at a fraction of the
CUDA cores' rate, and each weight element paid one per row tile): OR-ing a nibble q into the low mantissa bits of
2^23 (float32), 128 (bfloat16) or 1024 (float16) gives that power plus q exactly, and subtracting the power plus the
zero point leaves q - z, an exact small integer (the "magic number" conversion of FasterTransformer and Marlin; Kim
et al., "Who Says Elephants Can't Run", arXiv:2211.10017). The GEMV leaves nibbles in place (q x 16^p, see
`_nibble_at`) and subtracts the zero point once a word. The scale multiplies each group's partial product, not each
weight, so a weight needs no arithmetic past that one subtraction and its product.

Interpreter-safe: Triton's interpreter multiplies 16-bit floats' raw bits in tl.dot, truncates float32 -> bfloat16
casts and bitcasts bfloat16 wrongly, so there the dots take float32 inputs and bfloat16 models float32 nibbles
(omnirun.kernels.triton.modes.INTERPRETED).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from omnirun.kernels.triton.modes import INTERPRETED
from omnirun.kernels.triton.tiles import l2_grouped_tile
from omnirun.layers import native_ops

_F32_MAGIC = tl.constexpr(0x4B000000)  # 2^23 as float32 bits: its last mantissa bits hold an integer below 2^23 exactly


@triton.jit
def _float32_nibbles(q, zero):
    """q - zero in float32, exactly, from int32 nibbles and zero points (0..15), with no conversion instruction."""
    return (q | _F32_MAGIC).to(tl.float32, bitcast=True) - (zero | _F32_MAGIC).to(tl.float32, bitcast=True)


# The 16-bit floats whose last mantissa bit weighs 1: bfloat16 128 and float16 1024, as bits.
_MAGIC_16 = {torch.bfloat16: 0x4300, torch.float16: 0x6400}


@triton.jit
def _16bit_nibbles(q, dtype: tl.constexpr, magic: tl.constexpr):
    """Int32 values 0..15 as `dtype`'s `magic` + q, exactly, with no conversion instruction."""
    return (q | magic).to(tl.int16).to(dtype, bitcast=True)


@triton.jit
def _dot_nibbles(x, words, zero, MAGIC_16: tl.constexpr):
    """x [BM, BK] times the transposed (q - zero) [BN, BK] of `words` [BN, BK / 8] (input 8c + j in word c's nibble j)
    and the zero points [BN] (int32) of one group, on the tensor cores, in float32; q - zero is exact in x's dtype
    (`_16bit_nibbles`, MAGIC_16 x's magic as bits; float32's for float32 x)."""
    BLOCK_N: tl.constexpr = words.shape[0]
    BLOCK_K: tl.constexpr = words.shape[1] * 8
    q = tl.reshape((words[:, :, None] >> (tl.arange(0, 8) * 4)[None, None, :]) & 0xF, (BLOCK_N, BLOCK_K))
    dtype: tl.constexpr = x.dtype
    if dtype == tl.float32 or (INTERPRETED and dtype == tl.bfloat16):  # the interpreter's bf16 bitcasts are wrong
        w = _float32_nibbles(q, zero[:, None])
    else:
        w = _16bit_nibbles(q, dtype, MAGIC_16) - _16bit_nibbles(zero, dtype, MAGIC_16)[:, None]
    if INTERPRETED:  # the interpreter's dot multiplies 16-bit floats' raw bits: give it float32
        return tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)))
    if dtype == tl.float32:
        return tl.dot(x, tl.trans(w), input_precision="ieee")
    return tl.dot(x, tl.trans(w))


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
    stride_ys,  # the split's stride in y ([SPLIT_K, M, N] float32 partial sums when SPLIT_K > 1)
    K_SPLIT,  # inputs each split of K covers (a multiple of BLOCK_K)
    GROUP: tl.constexpr,  # inputs per scale: a multiple of BLOCK_K (a step lies in one group)
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    MAGIC_16: tl.constexpr,  # x's dtype's 16-bit float whose last mantissa bit weighs 1, as bits
):
    pid_m, pid_n = l2_grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    split = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    offs_w = tl.arange(0, BLOCK_K // 8)
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    s_rows = offs_n.to(tl.int64) * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(split * K_SPLIT, tl.minimum(K, (split + 1) * K_SPLIT), BLOCK_K):
        words = tl.load(
            w_rows + (k0 // 8 + offs_w)[None, :], mask=n_mask[:, None] & (k0 + offs_w * 8 < K)[None, :], other=0
        )  # [BN, BK / 8] int32
        kk = k0 + offs_k
        x = tl.load(x_rows + kk[None, :], mask=m_mask[:, None] & (kk < K)[None, :], other=0.0)  # [BM, BK]
        # one group per step: dot with q - z, then scale the [BM, BN] partial product
        s = tl.load(s_ptr + s_rows + k0 // GROUP, mask=n_mask, other=0.0)
        z = tl.load(z_ptr + s_rows + k0 // GROUP, mask=n_mask, other=0).to(tl.int32)
        acc += _dot_nibbles(x, words, z, MAGIC_16) * s[None, :]
    if HAS_BIAS:
        if split == 0:
            acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y = y_ptr + split * stride_ys + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _nibble_at(word, p: tl.constexpr, nibble_mask):
    """The nibble at bits 4p..4p+3 (p <= 4) of an int32 word as float32 q x 16^p, exactly, in one AND-OR and one
    subtraction: 2^23 with the nibble in place is 2^23 + q x 16^p, the nibble lying inside the mantissa."""
    return ((word & (nibble_mask << (4 * p))) | _F32_MAGIC).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _word_products(words, x, nibble_mask):
    """Each word's sum of its eight inputs times their nibbles q (zero points apart): words [N, W] int32, x [W, 8]
    float32. Nibbles 0-4 are read in place and nibbles 5-7 after one shift of the word by 12 bits, each
    as q x 16^p (`_nibble_at`), so x is divided by 16^p first (exact: powers of two), once for every row of the tile.
    The eight inputs of a word are split off x's last axis, which one thread holds: no exchange between threads."""
    even, odd = tl.split(tl.reshape(x, (x.shape[0], 2, 2, 2)))  # input 4a + 2b + c at [:, a, b] of c
    x0_4, x2_6 = tl.split(even)
    x1_5, x3_7 = tl.split(odd)
    x0, x4 = tl.split(x0_4)
    x2, x6 = tl.split(x2_6)
    x1, x5 = tl.split(x1_5)
    x3, x7 = tl.split(x3_7)
    high = words >> 12  # nibbles 5, 6, 7 at bits 8..19 (the masks drop the sign bits an arithmetic shift brings)
    part = _nibble_at(words, 0, nibble_mask) * x0[None, :]
    part += _nibble_at(words, 1, nibble_mask) * (x1 * 0.0625)[None, :]
    part += _nibble_at(words, 2, nibble_mask) * (x2 * 0.00390625)[None, :]
    part += _nibble_at(words, 3, nibble_mask) * (x3 * 0.000244140625)[None, :]
    part += _nibble_at(words, 4, nibble_mask) * (x4 * 0.0000152587890625)[None, :]
    part += _nibble_at(high, 2, nibble_mask) * (x5 * 0.00390625)[None, :]
    part += _nibble_at(high, 3, nibble_mask) * (x6 * 0.000244140625)[None, :]
    part += _nibble_at(high, 4, nibble_mask) * (x7 * 0.0000152587890625)[None, :]
    return part


@triton.jit
def _row_part(words, x_row, s, z, nibble_mask, GROUPS: tl.constexpr, SPAN: tl.constexpr):
    """One row's step: each word's products, less zero x the word's inputs, times its group's scale, kept apart by
    word: [BLOCK_N, GROUPS, SPAN / 8]. x_row [WORDS, 8] float32; s, z [BLOCK_N, GROUPS]."""
    part = tl.reshape(_word_products(words, x_row, nibble_mask), (words.shape[0], GROUPS, SPAN // 8))
    word_sums = tl.reshape(tl.sum(x_row, axis=1), (GROUPS, SPAN // 8))
    return (part - z[:, :, None] * word_sums[None, :, :]) * s[:, :, None]


@triton.jit
def _int4_step(w_ptr, s_ptr, z_ptr, rows, row_mask, k0, K, stride_wn, stride_sn, GROUP: tl.constexpr,
               BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):  # fmt: skip
    """A K step's operands of the GEMV's products: the words [BLOCK_N, BLOCK_K / 8] of `rows` at inputs k0.. (w_ptr
    [N, K / 8] of row stride stride_wn), and their groups' scales and zero points [BLOCK_N, GROUPS] in float32 (s_ptr
    and z_ptr [N, groups] of row stride stride_sn). Masked words are 0, masked groups' scales 0."""
    SPAN: tl.constexpr = GROUP if GROUP < BLOCK_K else BLOCK_K  # inputs of one group within a step
    word = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    w_rows = w_ptr + rows[:, None].to(tl.int64) * stride_wn
    if EVEN_K:
        words = tl.load(w_rows + word[None, :], mask=row_mask[:, None], other=0)
    else:
        words = tl.load(w_rows + word[None, :], mask=row_mask[:, None] & (word * 8 < K)[None, :], other=0)
    g = (k0 + tl.arange(0, BLOCK_K // SPAN) * SPAN) // GROUP
    g_mask = row_mask[:, None] & (g * GROUP < K)[None, :]
    s_rows = rows[:, None].to(tl.int64) * stride_sn
    s = tl.load(s_ptr + s_rows + g[None, :], mask=g_mask, other=0.0)
    z = tl.load(z_ptr + s_rows + g[None, :], mask=g_mask, other=0).to(tl.float32)
    return words, s, z


@triton.jit
def _load_row(x_ptr, row, M, stride_xm, kk, K, EVEN_K: tl.constexpr):
    """Row `row` of x at inputs kk [WORDS, 8] as float32; rows past M read row M - 1 (their sums are not stored)."""
    x_row = x_ptr + tl.minimum(row, M - 1).to(tl.int64) * stride_xm
    if EVEN_K:
        return tl.load(x_row + kk).to(tl.float32)
    return tl.load(x_row + kk, mask=kk < K, other=0.0).to(tl.float32)


@triton.jit
def _int4_gemv_kernel(
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
    nibble_mask,  # 0xF, as an argument: a constant mask would be loaded into a register before every AND-OR
    GROUP: tl.constexpr,  # inputs per scale: a multiple of 8 that divides BLOCK_K or is a multiple of it
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,  # K a multiple of BLOCK_K: no mask along K (the words load in 16-byte vectors)
    ROWS: tl.constexpr,  # rows of x a program: 1 or 2
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """y [M, N] = x [M, K] W^T on the CUDA cores, ROWS rows of x a program (program_id(0): a weight tile's programs
    run side by side, so all but the first read it from L2). Each thread sums the eight products of each word it
    holds (no exchange between threads), scales the sums by their groups' scales and adds them to an accumulator of
    the tile's shape; the threads' partial sums meet once, after the last step (a reduction per step cost more
    shuffles and adds than the products themselves). Each row's products are computed in the words' layout and
    joined along a last axis the thread holds (the nibbles, unpacked once, serve every row: the compiler merges the
    rows' identical unpacking); a [ROWS, ...] product broadcast from x's side made the compiler move every
    nibble through shared memory instead."""
    WORDS: tl.constexpr = BLOCK_K // 8
    SPAN: tl.constexpr = GROUP if GROUP < BLOCK_K else BLOCK_K  # inputs of one group within a step
    GROUPS: tl.constexpr = BLOCK_K // SPAN
    row0 = tl.program_id(0) * ROWS
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_w = tl.arange(0, WORDS)
    if ROWS == 1:
        acc = tl.zeros([BLOCK_N, GROUPS, SPAN // 8], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_N, GROUPS, SPAN // 8, 2], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = (k0 // 8 + offs_w)[:, None] * 8 + tl.arange(0, 8)[None, :]  # [WORDS, 8]: input 8c + j of word c
        words, s, z = _int4_step(w_ptr, s_ptr, z_ptr, offs_n, n_mask, k0, K, stride_wn, stride_sn, GROUP, BLOCK_K,
                                 EVEN_K)  # fmt: skip
        x0 = _load_row(x_ptr, row0, M, stride_xm, kk, K, EVEN_K)
        part = _row_part(words, x0, s, z, nibble_mask, GROUPS, SPAN)
        if ROWS == 2:
            x1 = _load_row(x_ptr, row0 + 1, M, stride_xm, kk, K, EVEN_K)
            part = tl.join(part, _row_part(words, x1, s, z, nibble_mask, GROUPS, SPAN))
        acc += part
    out = tl.reshape(tl.sum(tl.sum(acc, axis=2), axis=1), (BLOCK_N, ROWS))
    if HAS_BIAS:
        out += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    offs_m = row0 + tl.arange(0, ROWS)
    y = y_ptr + offs_m[None, :].to(tl.int64) * stride_ym + offs_n[:, None]
    tl.store(y, out.to(y_ptr.dtype.element_ty), mask=n_mask[:, None] & (offs_m < M)[None, :])


@triton.jit
def _dequantize_kernel(
    w_ptr,
    s_ptr,
    z_ptr,
    out_ptr,
    N,
    K,
    stride_wn,
    stride_sn,
    stride_on,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # a divisor of GROUP
):
    """out [N, K] = (q - z) * s, rounded once to out's dtype (the reference's weight)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    offs_w = tl.arange(0, BLOCK_K // 8)
    n_mask = offs_n < N
    words = tl.load(
        w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + (k0 // 8 + offs_w)[None, :],
        mask=n_mask[:, None] & (k0 + offs_w * 8 < K)[None, :],
        other=0,
    )
    q = tl.reshape((words[:, :, None] >> (tl.arange(0, 8) * 4)[None, None, :]) & 0xF, (BLOCK_N, BLOCK_K))
    s = tl.load(s_ptr + offs_n.to(tl.int64) * stride_sn + k0 // GROUP, mask=n_mask, other=0.0)
    z = tl.load(z_ptr + offs_n.to(tl.int64) * stride_sn + k0 // GROUP, mask=n_mask, other=0).to(tl.int32)
    w = _float32_nibbles(q, z[:, None]) * s[:, None]
    kk = k0 + tl.arange(0, BLOCK_K)
    out = out_ptr + offs_n[:, None].to(tl.int64) * stride_on + kk[None, :]
    tl.store(out, w.to(out_ptr.dtype.element_ty), mask=n_mask[:, None] & (kk < K)[None, :])


def _check_scales(scale: torch.Tensor, zero_point: torch.Tensor) -> None:
    """The kernels index scales and zero points alike, by row stride and group."""
    if scale.stride() != zero_point.stride() or scale.stride(1) != 1:
        raise ValueError("int4 scales and zero points must be contiguous [N, groups] alike")


def _check_inputs(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor) -> None:
    """What the GEMV and the GEMM take: 16-bit activations (their 16-bit nibble conversion) and scales as above."""
    if x.dtype not in _MAGIC_16:
        raise ValueError(
            f"the int4 kernels take bf16 or fp16 activations, not {x.dtype}: int4_linear gives others to the reference"
        )
    _check_scales(scale, zero_point)


def dequantized_linear(
    x: torch.Tensor,
    weight_packed: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    bias: torch.Tensor | None,
    group_size: int,
) -> torch.Tensor:
    """x [M, K] times the weight dequantized into a scratch [N, K] of x's dtype, then the device's own matmul: from
    DEQUANTIZE_MIN_ROWS rows the GEMM library's tiles beat unpacking the weight in every row tile (vLLM's AWQ path
    does the same from 256 tokens: awq_dequantize, then matmul)."""
    n, k = weight_packed.shape[0], x.shape[1]
    _check_scales(scale, zero_point)
    weight = torch.empty(n, k, dtype=x.dtype, device=x.device)
    block_k = k_step(group_size, 128)
    _dequantize_kernel[(triton.cdiv(n, 32), triton.cdiv(k, block_k))](
        weight_packed,
        scale,
        zero_point,
        weight,
        n,
        k,
        weight_packed.stride(0),
        scale.stride(0),
        weight.stride(0),
        GROUP=group_size,
        BLOCK_N=32,
        BLOCK_K=block_k,
    )
    return torch.nn.functional.linear(x, weight, bias)


def fits(group_size: int, block_k: int, rows: int = 2) -> bool:
    """Whether a K step of `block_k` serves groups of `group_size`: the dots take steps inside one group; the
    one-row reduction also takes steps of whole groups."""
    if group_size % block_k == 0:
        return True
    return rows == 1 and block_k % group_size == 0


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
    split_k: int | None,
) -> torch.Tensor:
    m, k = x.shape
    n = weight_packed.shape[0]
    if not fits(group_size, block_k, block_m):
        raise ValueError(f"int4 groups of {group_size} and a K step of {block_k}: the step must lie in one group")
    _check_inputs(x, scale, zero_point)
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    steps = triton.cdiv(k, block_k)
    split_k = min(split_k or splits_for(tiles, steps, x.device), steps)
    k_split = triton.cdiv(steps, split_k) * block_k
    split_k = triton.cdiv(k, k_split)  # no empty split
    if split_k == 1:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    else:
        out = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)
    _int4_kernel[(tiles, split_k)](
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
        n,
        m * n,
        k_split,
        GROUP=group_size,
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        GROUP_M=8,
        MAGIC_16=_MAGIC_16[x.dtype],
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out if split_k == 1 else out.sum(0).to(x.dtype)


_PROCESSORS: dict[tuple[str, int], int] = {}


def processors(device: torch.device) -> int:
    """The device's streaming multiprocessors (compute units), from Triton's driver; 1 in the interpreter."""
    if INTERPRETED:
        return 1
    key = (device.type, device.index or 0)
    if key not in _PROCESSORS:
        properties = triton.runtime.driver.active.utils.get_device_properties(key[1])
        # CUDA's and HIP's drivers name it so; a backend that does not gets no K split rather than an error
        _PROCESSORS[key] = properties.get("multiprocessor_count", 1)
    return _PROCESSORS[key]


def splits_for(tiles: int, steps: int, device: torch.device) -> int:
    """How many ways to split K so that the programs fill the device about twice (a few rows against a
    4,096-column layer make fewer output tiles than an H100 has multiprocessors), keeping 4 K steps a split."""
    split = 1
    while tiles * split * 2 <= 2 * processors(device) and steps // (split * 2) >= 4:
        split *= 2
    return split


def k_step(group_size: int, preferred: int, rows: int = 2) -> int:
    """The longest K step up to `preferred` (halving down to 16) that serves the groups; ValueError if none."""
    step = preferred
    while step >= 16:
        if fits(group_size, step, rows):
            return step
        step //= 2
    raise ValueError(f"int4 groups of {group_size}: no K step of 16 or more fits them")


def gemv(
    x: torch.Tensor,
    weight_packed: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    bias: torch.Tensor | None,
    group_size: int,
    *,
    rows: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 1,
) -> torch.Tensor:
    """x [M, K] (bf16/fp16) times the 4-bit weight on the CUDA cores, `rows` rows of x a program (decode at small
    batches); the rows, tile and warps `gemv_launch` picks unless given."""
    _check_inputs(x, scale, zero_point)
    m, k = x.shape
    n = weight_packed.shape[0]
    launch = gemv_launch(m, n, x.device)
    rows, block_n = rows or launch.rows, block_n or launch.block_n
    block_k, num_warps = block_k or launch.block_k, num_warps or launch.num_warps
    if rows not in (1, 2):
        raise ValueError(f"the int4 GEMV takes 1 or 2 rows a program, not {rows}")
    block_k = k_step(group_size, block_k, 1)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _int4_gemv_kernel[(triton.cdiv(m, rows), triton.cdiv(n, block_n))](
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
        0xF,
        GROUP=group_size,
        HAS_BIAS=bias is not None,
        EVEN_K=k % block_k == 0,
        ROWS=rows,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


class GemvLaunch(NamedTuple):
    rows: int  # rows of x a program
    block_n: int
    block_k: int
    num_warps: int


def gemv_launch(m: int, n: int, device: torch.device) -> GemvLaunch:
    """The GEMV's launch for m rows of x and an n-row weight. Up to two rows, one a program: a layer of few rows
    gives few programs (4,096 rows: 256 of 16, two an H100 multiprocessor), then each takes 2,048 inputs a step with
    8 warps, twice the loads in flight, else 1,024 with 4 (H100, four layers of each Llama-3-8B projection at one
    row, bench/results/h100_int4_gemv_tiles_dccb150.txt: 4,096 x 4,096 0.0248 ms against 0.0287, 4,096 x 14,336
    0.0714 against 0.0903; 6,144 x 4,096 0.0388 against 0.0426 and 28,672 x 4,096 0.1142 against 0.1342 the other
    way). Three and four rows: two a program, 16 x 1,024 with 4 warps (H100, the four projections x 4 layers,
    bench/results/h100_int4_gemv_rows_8806266.txt: 0.73 ms at 3 and 4 rows, against 0.77 for four rows a program
    and 0.93 for the GEMM; at two rows one a program 0.41, two 0.43)."""
    if m <= 2:
        if triton.cdiv(n, 16) <= 2 * processors(device):
            return GemvLaunch(1, 16, 2048, 8)
        return GemvLaunch(1, 16, 1024, 4)
    return GemvLaunch(2, 16, 1024, 4)


def gemm(
    x: torch.Tensor,
    weight_packed: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    bias: torch.Tensor | None,
    group_size: int,
    *,
    block_m: int | None = None,
    block_n: int = 128,
    block_k: int = 128,
    num_warps: int = 4,
    num_stages: int = 3,
    split_k: int | None = None,
) -> torch.Tensor:
    """x [M, K] (bf16/fp16) times the 4-bit weight on tensor-core dots, K split as `splits_for` says unless given.
    Row tiles of 16 up to 16 rows, else 64. H100, the four projections x 4 layers: 16 x 128 x 128 0.94 and 0.97 ms
    at 8 and 16 rows against 64 x 128 x 128's 1.05 (bench/results/h100_int4_gemv_rows_8806266.txt; on the H200 1.74
    against 1.07 at 24 rows); 64 x 128 x 128 was the fastest at 64 rows (1.09 ms, against 1.14 for 64-input K steps,
    h100_int4_linear_sweep_magic_46dd126.json)."""
    return _launch(
        x,
        weight_packed,
        scale,
        zero_point,
        bias,
        group_size,
        block_m=block_m or (16 if x.shape[0] <= 16 else 64),
        block_n=block_n,
        block_k=k_step(group_size, block_k),
        num_warps=num_warps,
        num_stages=num_stages,
        split_k=split_k,
    )


def takes(out_features: int, in_features: int, group_size: int, dtype: torch.dtype) -> bool:
    """`int4_linear_takes`: bf16/fp16 models with groups the dots' K steps fit (float32 models and odd groups
    dequantize at load rather than run the reference below)."""
    return dtype in _MAGIC_16 and group_size % 16 == 0


# Rows up to which the GEMV beats the GEMM's tensor-core dots, which unpack each weight tile into the dots' layout
# through shared memory (H100 sweep above: 0.73 ms at 4 rows against the GEMM's 0.93; 1.25 at 8 against 0.94).
GEMV_MAX_ROWS = 4

# Rows from which the weight is dequantized whole, then multiplied by the device's matmul (prefill, large batches).
# On the H100 sweep the GEMM took 1.09 ms at 64 rows and 3.43 at 256, dequantizing first 1.55 and 1.72: the GEMM
# unpacks every weight tile once per 64 rows, so its cost grows by about a third of that difference per 64 rows,
# and at 128 it would pass the dequantized path's (interpolated, 128 rows not measured).
DEQUANTIZE_MIN_ROWS = 128


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
    if not takes(weight_packed.shape[0], x.shape[-1], group_size, x.dtype) or rows.shape[0] == 0:
        # float32 models, and groups no published checkpoint has (e.g. 40): the reference, correct but not fast
        return native_ops.int4_linear(x, weight_packed, weight_scale, weight_zero_point, bias, group_size)
    if rows.shape[0] <= GEMV_MAX_ROWS:
        kernel = gemv
    else:
        kernel = gemm if rows.shape[0] < DEQUANTIZE_MIN_ROWS else dequantized_linear
    out = kernel(rows, weight_packed, weight_scale, weight_zero_point, bias, group_size)
    return out.reshape(*x.shape[:-1], weight_packed.shape[0])
