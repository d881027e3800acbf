"""A batch-invariant matmul in Triton: y = x W^T + b whose every element is reduced in the same order for any
number of rows (deterministic mode's linear layers; vLLM's batch-invariant mode uses a Triton matmul likewise).

cuBLAS picks its kernel, tiles and split-K by the problem's shape, so a row's result changes with the batch around
it. Here the tiles are a function of the weight's shape alone (never of the row count): each output element sums
K in blocks of BLOCK_K, left to right, with the same `tl.dot` shapes, whatever M is and wherever its row falls in
a tile. Narrow layers may split K into a fixed number of parts (again by the weight's shape): each part sums its
blocks in order into a float32 workspace, and the parts are added left to right, so the order stays fixed.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl

from omnirun.kernels.triton.tiles import l2_grouped_tile

_INTERPRETING = bool(triton.knobs.runtime.interpret)
BLOCK_M = 64
_DOT_TYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


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
    stride_os,
    k_per_split,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_TY: tl.constexpr,
):
    pid_m, pid_n = l2_grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)

    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    # This program's part of K (all of it without a split): whole blocks, the same for every M.
    k_lo = tl.program_id(1) * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        ks = k0 + offs_k
        mask_k = ks < k_hi
        x = tl.load(X + offs_m[:, None] * stride_xm + ks[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(W + offs_n[None, :] * stride_wn + ks[:, None], mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        acc = tl.dot(x.to(DOT_TY), w.to(DOT_TY), acc, input_precision="ieee")
    if HAS_BIAS:
        acc += tl.load(Bias + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    out_ptrs = Out + tl.program_id(1) * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(Out.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@dataclasses.dataclass(frozen=True)
class Tiles:
    """One weight shape's launch: output columns and K per block, K parts, pipeline stages, warps."""

    block_n: int
    block_k: int = 64
    split_k: int = 1
    num_stages: int = 4
    num_warps: int = 4


def tiles(out_features: int, in_features: int, element_size: int = 2) -> Tiles:
    """The launch for a weight of this shape and element size, from those alone (never from the row count). Swept
    on an H200 over Llama-3-8B's shapes at 1, 32 and 256 rows in bf16 (bench/batch_invariant_matmul_sweep.py,
    bench/results/h200_batch_invariant_matmul_sweep.json): wide layers take 128-column tiles; a narrow one with a
    long K (the MLP's down projection) splits K in two; other narrow ones take 32-column tiles, so that batch 1
    has enough programs to stream the weight. Float32 weights take K in blocks of 64: blocks of 128 need 288 KiB of
    shared memory at 128 columns, more than an H100 has (227 KiB)."""
    block_k = 128 if element_size <= 2 else 64
    if out_features > 8192:
        return Tiles(block_n=128, block_k=block_k)
    if in_features >= 2 * out_features:
        return Tiles(block_n=128, block_k=block_k, split_k=2)
    return Tiles(block_n=32, block_k=block_k)


def _stages_that_fit(t: Tiles, element_size: int, device: torch.device) -> int:
    """`t.num_stages`, or fewer where the device's shared memory cannot hold that many tiles of x and W (Triton
    keeps num_stages - 1 in flight). Stages only pipeline the loads: a row's sums keep their order."""
    if _INTERPRETING or device.index is None:
        return t.num_stages
    limit = _shared_memory_bytes(device.index)
    per_stage = (BLOCK_M + t.block_n) * t.block_k * element_size
    return max(2, min(t.num_stages, limit // per_stage + 1)) if limit else t.num_stages


@functools.cache
def _shared_memory_bytes(device_index: int) -> int | None:
    """Shared memory a program may use on this device, as Triton's driver reports it (None where it does not)."""
    properties = triton.runtime.driver.active.utils.get_device_properties(device_index)
    return properties.get("max_shared_mem") if isinstance(properties, dict) else None


def batch_invariant_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    prepared: object = None,
    *,
    launch: Tiles | None = None,
) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T (+ bias [N]) -> [..., N] in x's dtype; `prepared` is unused (plain weights).
    `launch` replaces the shape's tiles (the tuning sweep)."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    m, k = rows.shape
    n = weight.shape[0]
    t = launch or tiles(n, k, weight.element_size())
    blocks_per_split = triton.cdiv(triton.cdiv(k, t.block_k), t.split_k)
    split = triton.cdiv(triton.cdiv(k, t.block_k), blocks_per_split)  # parts that hold blocks
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if not (m and n):
        return out.view(*x.shape[:-1], n)
    # Split parts land in float32 and are summed below; one part writes the output (and adds the bias) itself.
    target = out if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    # The interpreter's bf16 tl.dot multiplies bit patterns (triton-lang/triton#11584): float32 there.
    dot_ty = tl.float32 if _INTERPRETING else _DOT_TYPES.get(x.dtype, tl.float32)
    grid = (triton.cdiv(m, BLOCK_M) * triton.cdiv(n, t.block_n), split)
    _matmul_kernel[grid](
        rows,
        weight,
        bias if bias is not None and split == 1 else weight,
        target,
        m,
        n,
        k,
        rows.stride(0),
        weight.stride(0),
        target.stride(-2),
        target.stride(0) if split > 1 else 0,
        blocks_per_split * t.block_k,
        HAS_BIAS=bias is not None and split == 1,
        BLOCK_M=BLOCK_M,
        BLOCK_N=t.block_n,
        BLOCK_K=t.block_k,
        GROUP_M=8,
        DOT_TY=dot_ty,
        num_warps=t.num_warps,
        num_stages=_stages_that_fit(t, max(rows.element_size(), weight.element_size()), x.device),
    )
    if split > 1:  # the parts added left to right, the same order for every row; the last add writes the output
        total = target[0]
        for part in target[1:-1]:
            total = total + part
        if bias is None:
            torch.add(total, target[-1], out=out)
        else:
            torch.add(total + target[-1], bias, out=out)
    return out.view(*x.shape[:-1], n)
