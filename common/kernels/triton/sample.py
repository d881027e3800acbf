"""The `sample` op as one Triton kernel, without a sort: temperature, top-k, top-p and min-p cuts found by search,
then the exponential race, one program per row.

Each row's logits are scaled as the reference scales them, d = (max - x) / temperature >= 0 (0 for the most likely
token, larger for less likely ones; the probability is exp(-d) / Z). A filter keeps the tokens with d at most a
cut, found by searching the bits of non-negative float32 values, whose integer order is their order (each pass
over the row tries SEARCH_PIVOTS cuts at once):
- top-k: the smallest cut that keeps at least k tokens (every token tied with the k-th stays, as in the reference),
  and a count of exactly k ends the search early;
- top-p: the smallest cut, no larger than top-k's, whose kept mass reaches top_p of what top-k kept (the whole tie
  at the cut stays, as in the reference);
- min-p: a token stays where exp(-d) >= min_p (min_p times the most likely token's probability).
Each search step reads the row once (from L2 for all but the largest batches); a row with a filter off skips its
passes. The race draws q ~ Exponential(1) from the same counter-based hash as the reference
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
# Each search step tries SEARCH_PIVOTS cuts in one pass over the row and keeps 1/SEARCH_PIVOTS of the range: 16
# pivots find a cut among 2**31 bit patterns in 8 passes (2 pivots, a bisection, in 31).
SEARCH_PIVOTS = 16
_SEARCH_STEPS = tl.constexpr(31)  # enough for 2 pivots; a search with more stops early (lo == hi)

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
def _pivots(lo, hi, PIVOTS: tl.constexpr):
    """PIVOTS cut candidates (int32 float bits) splitting [lo, hi] evenly, the last one hi: a search step tries them
    all in one pass over the row."""
    step = (hi - lo + PIVOTS) // PIVOTS  # ceil((hi - lo + 1) / PIVOTS): no int32 overflow below +inf's bits
    return tl.minimum(lo + (tl.arange(0, PIVOTS) + 1) * step - 1, hi)


@triton.jit
def _kept_at(row_ptr, vocab, top, temperature, pivots, MASS: tl.constexpr, BLOCK: tl.constexpr):
    """For each cut of `pivots` (float bits): how many tokens have d <= cut, or (MASS) the sum of their exp(-d)."""
    cuts = pivots.to(tl.float32, bitcast=True)[:, None]
    total = tl.zeros(pivots.shape, tl.float32 if MASS else tl.int32)
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        d = _scaled(row_ptr, offs, vocab, top, temperature)
        kept = (d[None, :] <= cuts) & (offs < vocab)[None, :]
        if MASS:
            total += tl.sum(tl.where(kept, tl.exp(-d)[None, :], 0.0), axis=1)
        else:
            total += tl.sum(kept.to(tl.int32), axis=1)
    return total


@triton.jit
def _narrow(lo, pivots, holds, PIVOTS: tl.constexpr):
    """The new [lo, hi] after one search step: hi the first pivot where the condition holds (the last always
    does), lo one past the pivot before it. Also the index of that pivot."""
    index = tl.arange(0, PIVOTS)
    first = PIVOTS - tl.sum(holds.to(tl.int32), axis=0)  # the condition holds from `first` on
    hi = tl.sum(tl.where(index == first, pivots, 0), axis=0)
    below = tl.sum(tl.where(index == first - 1, pivots, 0), axis=0)
    lo = tl.where(first == 0, lo, below + 1)
    return lo, hi, first


@triton.jit
def _smallest_cut(
    row_ptr, vocab, top, temperature, hi, need, MASS: tl.constexpr, PIVOTS: tl.constexpr, BLOCK: tl.constexpr
):
    """The smallest cut (float bits, at most `hi`) that keeps at least `need` tokens, or (MASS) at least `need` of
    probability mass. A count of exactly `need` ends the search at once: no tie crosses that cut."""
    lo = tl.full((), 0, tl.int32)
    for _ in range(_SEARCH_STEPS):
        if lo < hi:
            pivots = _pivots(lo, hi, PIVOTS)
            kept = _kept_at(row_ptr, vocab, top, temperature, pivots, MASS, BLOCK)
            lo, hi, first = _narrow(lo, pivots, kept >= need, PIVOTS)
            if not MASS:
                if tl.sum(tl.where(tl.arange(0, PIVOTS) == first, kept, 0), axis=0) == need:
                    lo = hi
    return hi


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
    PIVOTS: tl.constexpr,
    BLOCK: tl.constexpr,
    SEARCH_BLOCK: tl.constexpr,
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
            cut_bits = _smallest_cut(row_ptr, vocab, top, temperature, cut_bits, k, False, PIVOTS, SEARCH_BLOCK)
    if TOP_P:
        top_p = tl.load(top_ps_ptr + row)
        if top_p < 1.0:
            # Within top-k's cut: the smallest cut whose kept mass reaches top_p of top-k's.
            total = _kept_at(row_ptr, vocab, top, temperature, tl.full((1,), 0, tl.int32) + cut_bits, True, BLOCK)
            need = top_p * tl.sum(total, axis=0)
            cut_bits = _smallest_cut(row_ptr, vocab, top, temperature, cut_bits, need, True, PIVOTS, SEARCH_BLOCK)
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


def sample(logits: torch.Tensor, batch: SamplingBatch, pivots: int = SEARCH_PIVOTS) -> torch.Tensor:
    """The `sample` op (omnirun.sampling.reference.sample's contract): int64 [B]. Layouts and dtypes the kernel
    does not take go to the reference. `pivots`: cuts tried per pass of a search (a power of two >= 2)."""
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
        PIVOTS=pivots,
        BLOCK=block,
        SEARCH_BLOCK=max(4 * block // pivots, 64),
        num_warps=8 if block >= 2048 else 4,
    )
    return out
