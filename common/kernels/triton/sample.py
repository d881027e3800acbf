"""The `sample` op as one Triton kernel, without a full sort: temperature, top-k, top-p and min-p cuts, then the
exponential race, one program per row.

A row with top-k first looks at its short list: the batch's `max_top_k + TIE_ROOM` largest logits, sorted, from
torch.topk (a multi-block select, fast at any batch). When the list holds the k-th value's whole tie (its last value
is strictly smaller, or it holds the whole vocabulary), every cut and the race happen in registers on the list,
with no pass over the vocabulary. A row with top-p and no top-k (when the batch has one, the list is MAX_SHORTLIST
long) sums its whole row's mass in one pass and cuts the list when its nucleus, with the tie at its end, lies
inside. Any other row searches its whole row, as follows.

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
from omnirun.sampling.shortlist import GRAPH_WIDTHS, MAX_SHORTLIST, TIE_ROOM
from omnirun.sampling.shortlist import shortlist as plan_shortlist

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
_NO_TOKEN = tl.constexpr(2**62)  # larger than any token id: the minimum over no tied token
# The short list (omnirun.sampling.shortlist): each row's max_top_k + TIE_ROOM largest logits, at most MAX_SHORTLIST.
__all__ = ["MAX_SHORTLIST", "SEARCH_PIVOTS", "TIE_ROOM", "sample"]


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
    # Summed across the block once per pass, not once per block: a reduction across warps costs a barrier.
    total = tl.zeros((pivots.shape[0], BLOCK), tl.float32 if MASS else tl.int32)
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        d = _scaled(row_ptr, offs, vocab, top, temperature)
        kept = (d[None, :] <= cuts) & (offs < vocab)[None, :]
        if MASS:
            total += tl.where(kept, tl.exp(-d)[None, :], 0.0)
        else:
            total += kept.to(tl.int32)
    return tl.sum(total, axis=1)


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


@triton.jit
def _race(key, ids, weight, keep):
    """The exponential race among the kept tokens `ids` with weights exp(-d): the largest weight / q wins, q ~
    Exponential(1) hashed from the row's key and the token id (counter_rng.exponentials). Returns the best score
    and, of the tokens that reach it, the smallest id (argmax's first index)."""
    bits = (_mix(key + (ids.to(tl.int64) + 1) * _GOLDEN) >> _UNIFORM_SHIFT) & _UNIFORM_MASK
    q = tl.maximum(-tl.log((bits + 1).to(tl.float32) * _UNIFORM_SCALE), _Q_MIN)
    score = tl.where(keep, weight / q, -1.0)
    best = tl.max(score, axis=0)
    return best, tl.min(tl.where(score == best, ids.to(tl.int64), _NO_TOKEN), axis=0)


@triton.jit
def _sample_candidates(
    vals_ptr,
    ids_ptr,
    count,
    temperature,
    k,
    top_p,
    min_p,
    key,
    TOP_P: tl.constexpr,
    MIN_P: tl.constexpr,
    CANDIDATES: tl.constexpr,
):
    """A row's draw from its `count` largest logits (sorted, descending), which hold the whole top-k and its tie:
    top-k, top-p and min-p cut this short list in registers, and no pass over the vocabulary is needed."""
    index = tl.arange(0, CANDIDATES)
    vals = tl.load(vals_ptr + index, mask=index < count, other=float("-inf")).to(tl.float32)
    top = tl.max(vals, axis=0)
    d = -((vals - top) / temperature)
    d_kth = tl.sum(tl.where(index == k - 1, d, 0.0), axis=0)
    keep = d <= d_kth
    weight = tl.exp(-d)
    if TOP_P:
        if top_p < 1.0:
            # The nucleus in sorted order: the first token where the running mass reaches top_p of top-k's, then
            # every token tied with it (top-k's tokens lead the list; if rounding never lets the running mass reach
            # the goal, all of them stay).
            kept_weight = tl.where(keep, weight, 0.0)
            running = tl.cumsum(kept_weight, axis=0)
            needed = tl.sum((running < top_p * tl.sum(kept_weight, axis=0)).to(tl.int32), axis=0)
            needed = tl.minimum(needed, tl.sum(keep.to(tl.int32), axis=0) - 1)
            keep = keep & (d <= tl.sum(tl.where(index == needed, d, 0.0), axis=0))
    if MIN_P:
        keep = keep & (weight >= min_p)
    ids = tl.load(ids_ptr + index, mask=index < count, other=0)
    _, token = _race(key, ids, weight, keep)
    return token


@triton.jit
def _listed_nucleus(row_ptr, vocab, listed, index, count, temperature, top_p, BLOCK: tl.constexpr):
    """For a row without top-k whose `count` largest logits are `listed` (sorted, descending): one past the index
    of the nucleus's last token when the nucleus and the whole tie at its cut lie inside the list, else 0. The
    goal is top_p of the whole row's mass, summed in one pass as the search sums it."""
    top = tl.max(listed, axis=0)
    whole_row = tl.full((1,), _INF_BITS, tl.int32)
    total = tl.sum(_kept_at(row_ptr, vocab, top, temperature, whole_row, True, BLOCK), axis=0)
    d = -((listed - top) / temperature)
    running = tl.cumsum(tl.where(index < count, tl.exp(-d), 0.0), axis=0)
    needed = tl.sum((running < top_p * total).to(tl.int32), axis=0)  # the first index whose running mass reaches it
    d_cut = tl.sum(tl.where(index == needed, d, 0.0), axis=0)
    d_last = tl.sum(tl.where(index == count - 1, d, 0.0), axis=0)
    inside = (needed < count) & ((count == vocab) | (d_last > d_cut))
    return tl.where(inside, needed + 1, 0).to(tl.int64)


@triton.jit
def _sample_row(
    row_ptr,
    vocab,
    temperature,
    k,
    top_p,
    min_p,
    key,
    TOP_K: tl.constexpr,
    TOP_P: tl.constexpr,
    MIN_P: tl.constexpr,
    PIVOTS: tl.constexpr,
    BLOCK: tl.constexpr,
    SEARCH_BLOCK: tl.constexpr,
):
    """A row's draw from its whole vocabulary: the cuts found by search, then the race, a pass each."""
    top = tl.full((), float("-inf"), tl.float32)
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(row_ptr + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
        top = tl.maximum(top, tl.max(x, axis=0))

    cut_bits = tl.full((), _INF_BITS, tl.int32)  # keep d <= the float with these bits
    if TOP_K:
        if k > 0:
            cut_bits = _smallest_cut(row_ptr, vocab, top, temperature, cut_bits, k, False, PIVOTS, SEARCH_BLOCK)
    if TOP_P:
        if top_p < 1.0:
            # Within top-k's cut: the smallest cut whose kept mass reaches top_p of top-k's.
            total = _kept_at(row_ptr, vocab, top, temperature, tl.full((1,), 0, tl.int32) + cut_bits, True, BLOCK)
            need = top_p * tl.sum(total, axis=0)
            cut_bits = _smallest_cut(row_ptr, vocab, top, temperature, cut_bits, need, True, PIVOTS, SEARCH_BLOCK)

    cut = cut_bits.to(tl.float32, bitcast=True)
    best = tl.full((), -1.0, tl.float32)
    best_id = tl.full((), 0, tl.int64)
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        d = _scaled(row_ptr, offs, vocab, top, temperature)
        weight = tl.exp(-d)
        keep = (d <= cut) & (offs < vocab)
        if MIN_P:
            keep = keep & (weight >= min_p)
        block_best, block_id = _race(key, offs, weight, keep)
        if block_best > best:  # strictly: the first token of equal scores wins, as argmax picks
            best = block_best
            best_id = block_id
    return best_id


@triton.jit(do_not_specialize=["vocab", "stride", "count", "list_stride"])
def _sample_kernel(
    logits_ptr,
    stride,
    vocab,
    temperatures_ptr,
    top_ks_ptr,
    top_ps_ptr,
    min_ps_ptr,
    keys_ptr,
    vals_ptr,
    ids_ptr,
    list_stride,
    count,
    counts_ptr,
    nucleus_ptr,
    out_ptr,
    TOP_K: tl.constexpr,
    TOP_P: tl.constexpr,
    MIN_P: tl.constexpr,
    CANDIDATES: tl.constexpr,
    NUCLEUS: tl.constexpr,
    LIST_ON_DEVICE: tl.constexpr,
    PIVOTS: tl.constexpr,
    BLOCK: tl.constexpr,
    SEARCH_BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    temperature = tl.load(temperatures_ptr + row)
    key = tl.load(keys_ptr + row)
    k = tl.full((), 0, tl.int64)
    if TOP_K:
        k = tl.load(top_ks_ptr + row)
        k = tl.where((k > 0) & (k < vocab), k, 0)  # 0: no top-k cut (a k of the whole vocabulary cuts nothing)
    top_p = 1.0
    if TOP_P:
        top_p = tl.load(top_ps_ptr + row)
    min_p = 0.0
    if MIN_P:
        min_p = tl.load(min_ps_ptr + row)

    token = tl.full((), -1, tl.int64)  # -1: not drawn from a short list (one search call below serves every case)
    # The short list serves a row whose top-k, with every token tied with its k-th, lies inside it: all of the
    # vocabulary is listed, or the k-th is listed and the last listed is strictly smaller.
    if CANDIDATES > 0:
        # The graph form (LIST_ON_DEVICE): a list `list_stride` wide, of which each row reads what the same batch
        # would have listed eagerly (its length, and whether top-p rows may cut a nucleus in it, from the device).
        nucleus = tl.full((), NUCLEUS, tl.int1)
        if LIST_ON_DEVICE:
            count = tl.load(counts_ptr + row)
            nucleus = tl.load(nucleus_ptr + row) != 0
        index = tl.arange(0, CANDIDATES)
        listed = tl.load(vals_ptr + row * list_stride + index, mask=index < count, other=float("-inf"))
        listed = listed.to(tl.float32)
        kth = tl.sum(tl.where(index == k - 1, listed, 0.0), axis=0)
        last = tl.sum(tl.where(index == count - 1, listed, 0.0), axis=0)
        listed_top_k = (k >= 1) & ((count == vocab) | ((k < count) & (last < kth)))
        if NUCLEUS:
            # A row with top-p and no top-k: its nucleus, with the whole tie at its cut, may lie in the list too.
            # Then it is top-k with k one past the nucleus's last token, and no top-p left to apply.
            if nucleus & (listed_top_k == 0) & (k == 0) & (top_p < 1.0):
                k_nucleus = _listed_nucleus(
                    logits_ptr + row * stride, vocab, listed, index, count, temperature, top_p, BLOCK
                )
                if k_nucleus > 0:
                    k = k_nucleus
                    top_p = tl.full((), 1.0, tl.float32)
                    listed_top_k = k >= 1
        if listed_top_k:
            token = _sample_candidates(
                vals_ptr + row * list_stride,
                ids_ptr + row * list_stride,
                count,
                temperature,
                tl.minimum(k, count),
                top_p,
                min_p,
                key,
                TOP_P,
                MIN_P,
                CANDIDATES,
            )
    if token < 0:  # no short list, or the row's cuts do not fit it: search the whole row
        token = _sample_row(
            logits_ptr + row * stride,
            vocab,
            temperature,
            k,
            top_p,
            min_p,
            key,
            TOP_K,
            TOP_P,
            MIN_P,
            PIVOTS,
            BLOCK,
            SEARCH_BLOCK,
        )
    tl.store(out_ptr + row, token)


def sample(
    logits: torch.Tensor, batch: SamplingBatch, pivots: int = SEARCH_PIVOTS, shortlist: bool = True
) -> torch.Tensor:
    """The `sample` op (omnirun.sampling.reference.sample's contract): int64 [B]. Layouts and dtypes the kernel
    does not take go to the reference. `pivots`: cuts tried per pass of a search (a power of two >= 2);
    `shortlist`: with top-k on, first take each row's largest logits with torch.topk (a multi-block select), so
    that rows whose top-k fits skip the searches (False: every row searches its whole vocabulary).

    A batch in the graph form (`batch.shortlist_width` set: a decode graph's sampler) lists that many logits and
    reads each row's list length from `batch.shortlist_count` and `batch.shortlist_nucleus` on the device, what
    the same batch would have listed eagerly: a row then takes the path it takes eagerly and draws the same token.
    The list always sits in MAX_SHORTLIST registers, so that its sums round alike whatever its length."""
    if logits.dim() != 2 or logits.stride(-1) != 1 or logits.dtype not in _KERNEL_DTYPES:
        return reference.sample(logits, batch)
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    vals = ids = counts = nucleus_rows = out  # unread placeholders where there is no short list
    on_device = batch.shortlist_width is not None
    if on_device:
        width, nucleus = min(vocab, batch.shortlist_width), batch.shortlist_width > 0
        counts, nucleus_rows = batch.shortlist_count, batch.shortlist_nucleus
        count = width
    else:
        listed = plan_shortlist(batch.any_top_k, batch.any_top_p_alone, batch.max_top_k, vocab)
        width = count = listed.length if shortlist else 0
        nucleus = listed.nucleus and count > 0
    if width:
        vals, ids = torch.topk(logits, width, dim=-1, sorted=True)
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
        vals,
        ids,
        width,
        count,
        counts,
        nucleus_rows,
        out,
        TOP_K=batch.any_top_k,
        TOP_P=batch.any_top_p,
        MIN_P=batch.any_min_p,
        CANDIDATES=MAX_SHORTLIST if width else 0,
        NUCLEUS=nucleus,
        LIST_ON_DEVICE=on_device,
        PIVOTS=pivots,
        BLOCK=block,
        SEARCH_BLOCK=max(4 * block // pivots, 64),
        num_warps=8 if block >= 2048 else 4,
    )
    return out


# The op serves a decode graph's sampler (omnirun.graphs): its token for a row depends on the row and the list
# length above alone, not on which other flags the batch sets; a graph captures one sampler per list width.
sample.graph_widths = GRAPH_WIDTHS
