"""The `sample` op as one Triton kernel, without a sort: temperature, top-k, top-p and min-p thresholds found by
bisection, then the exponential race, one program per row.

Each row's logits are scaled as the reference scales them, d = (max - x) / temperature >= 0 (0 for the most likely
token, larger for less likely ones; the probability is exp(-d) / Z). A filter keeps the tokens with d at most a
cut, found by bisecting over the bits of non-negative float32 values, whose integer order is their order:
- top-k: the smallest cut that keeps at least k tokens (every token tied with the k-th stays, as in the reference),
  and a count of exactly k ends the search early;
- top-p: the smallest cut, no larger than top-k's, whose kept mass reaches top_p of what top-k kept (the whole tie
  at the cut stays, as in the reference);
- min-p: a token stays where exp(-d) >= min_p (min_p times the most likely token's probability).
Each step of a bisection reads the row once (from L2 for all but the largest batches); a row with a filter off
skips its passes. The race draws q ~ Exponential(1) from the same counter-based hash as the reference
(omnirun.sampling.counter_rng), so a seeded row draws the same numbers in both.

Importing this module imports triton; the capability gate (omnirun.kernels) offers it only where triton runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from omnirun.sampling import counter_rng, reference

if TYPE_CHECKING:
    from omnirun.sampling.sampler import SamplingBatch

_GOLDEN = tl.constexpr(counter_rng.GOLDEN)
_MIX_1 = tl.constexpr(counter_rng.MIX_1)
_MIX_2 = tl.constexpr(counter_rng.MIX_2)
_UNIFORM_SHIFT = tl.constexpr(64 - counter_rng.UNIFORM_BITS)
_UNIFORM_MASK = tl.constexpr((1 << counter_rng.UNIFORM_BITS) - 1)
_UNIFORM_SCALE = tl.constexpr(2.0**-counter_rng.UNIFORM_BITS)
_Q_MIN = tl.constexpr(counter_rng.Q_MIN)
_INF_BITS = tl.constexpr(0x7F800000)  # +inf as int32 bits: every finite d and +inf lie at or below it
_BISECTION_STEPS = tl.constexpr(31)  # one per bit of a non-negative float32

_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _mix(x):
    """splitmix64's finaliser in wrapping int64 arithmetic: counter_rng.mix. `(x >> n) & (2**(64 - n) - 1)` is a
    logical shift of the bits (>> keeps the sign of a signed integer)."""
    x = (x ^ ((x >> 30) & 0x3FFFFFFFF)) * _MIX_1
    x = (x ^ ((x >> 27) & 0x1FFFFFFFFF)) * _MIX_2
    return x ^ ((x >> 31) & 0x1FFFFFFFF)


@triton.jit
def _scaled(row_ptr, offs, vocab, top, temperature):
    """d = (max - x) / temperature of the tokens at `offs` (+inf past the vocabulary)."""
    x = tl.load(row_ptr + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
    return -((x - top) / temperature)


@triton.jit
def _count_kept(row_ptr, vocab, top, temperature, cut, BLOCK: tl.constexpr):
    """How many tokens have d <= cut."""
    count = tl.full((), 0, tl.int32)
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        d = _scaled(row_ptr, offs, vocab, top, temperature)
        count += tl.sum(((d <= cut) & (offs < vocab)).to(tl.int32), axis=0)
    return count


@triton.jit
def _mass_kept(row_ptr, vocab, top, temperature, cut, BLOCK: tl.constexpr):
    """The sum of exp(-d) over the tokens with d <= cut."""
    mass = tl.full((), 0.0, tl.float32)
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        d = _scaled(row_ptr, offs, vocab, top, temperature)
        mass += tl.sum(tl.where((d <= cut) & (offs < vocab), tl.exp(-d), 0.0), axis=0)
    return mass


@triton.jit(do_not_specialize=["vocab", "stride"])
def _sample_kernel(
    logits_ptr,
    stride,
    vocab,
    temperatures_ptr,
    top_ks_ptr,
    top_ps_ptr,
    min_ps_ptr,
    keys_ptr,
    out_ptr,
    TOP_K: tl.constexpr,
    TOP_P: tl.constexpr,
    MIN_P: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride
    temperature = tl.load(temperatures_ptr + row)
    top = tl.full((), float("-inf"), tl.float32)
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(row_ptr + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
        top = tl.maximum(top, tl.max(x, axis=0))

    cut_bits = tl.full((), _INF_BITS, tl.int32)  # keep d <= the float with these bits
    if TOP_K:
        k = tl.load(top_ks_ptr + row)
        if k < vocab:
            lo = tl.full((), 0, tl.int32)
            hi = cut_bits
            for _ in range(_BISECTION_STEPS):
                if lo < hi:
                    mid = lo + (hi - lo) // 2
                    count = _count_kept(row_ptr, vocab, top, temperature, mid.to(tl.float32, bitcast=True), BLOCK)
                    if count == k:  # exactly the top k: no tie crosses this cut
                        lo = mid
                        hi = mid
                    elif count > k:
                        hi = mid
                    else:
                        lo = mid + 1
            cut_bits = hi
    if TOP_P:
        top_p = tl.load(top_ps_ptr + row)
        if top_p < 1.0:
            total = _mass_kept(row_ptr, vocab, top, temperature, cut_bits.to(tl.float32, bitcast=True), BLOCK)
            target = top_p * total
            lo = tl.full((), 0, tl.int32)
            hi = cut_bits
            for _ in range(_BISECTION_STEPS):
                if lo < hi:
                    mid = lo + (hi - lo) // 2
                    mass = _mass_kept(row_ptr, vocab, top, temperature, mid.to(tl.float32, bitcast=True), BLOCK)
                    if mass >= target:
                        hi = mid
                    else:
                        lo = mid + 1
            cut_bits = hi
    min_p = 0.0
    if MIN_P:
        min_p = tl.load(min_ps_ptr + row)

    cut = cut_bits.to(tl.float32, bitcast=True)
    key = tl.load(keys_ptr + row)
    best = tl.full((), -1.0, tl.float32)
    best_id = tl.full((), 0, tl.int64)
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        d = _scaled(row_ptr, offs, vocab, top, temperature)
        weight = tl.exp(-d)
        keep = (d <= cut) & (offs < vocab) & (weight >= min_p)
        bits = (_mix(key + (offs.to(tl.int64) + 1) * _GOLDEN) >> _UNIFORM_SHIFT) & _UNIFORM_MASK
        q = tl.maximum(-tl.log((bits + 1).to(tl.float32) * _UNIFORM_SCALE), _Q_MIN)
        score = tl.where(keep, weight / q, -1.0)
        block_best = tl.max(score, axis=0)
        if block_best > best:  # strictly: the first token of equal scores wins, as argmax picks
            best = block_best
            best_id = start + tl.argmax(score, axis=0).to(tl.int64)
    tl.store(out_ptr + row, best_id)


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The `sample` op (omnirun.sampling.reference.sample's contract): int64 [B]. Layouts and dtypes the kernel
    does not take go to the reference."""
    if logits.dim() != 2 or logits.stride(-1) != 1 or logits.dtype not in _KERNEL_DTYPES:
        return reference.sample(logits, batch)
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    block = min(4096, triton.next_power_of_2(vocab))
    _sample_kernel[(rows,)](
        logits,
        logits.stride(0),
        vocab,
        batch.temperatures,
        batch.top_ks,
        batch.top_ps,
        batch.min_ps,
        batch.keys,
        out,
        TOP_K=batch.any_top_k,
        TOP_P=batch.any_top_p,
        MIN_P=batch.any_min_p,
        BLOCK=block,
        num_warps=8 if block >= 2048 else 4,
    )
    return out
