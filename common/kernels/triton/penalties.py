"""The `apply_penalties` op as one Triton kernel: one pass over the [B, V] logits.

The reference (omnirun.sampling.adjust.apply_penalties) runs about a dozen elementwise torch ops, each a pass over
[B, V] float32: at 256 rows of a 128k vocabulary about 4 GB of memory traffic, a millisecond and more on an H100.
Here each program reads a block of one row's logits, its counts and prompt marks, and writes the float32 result
once. Same operations in the same order as the reference, each rounded as torch rounds it (no FMA, IEEE division).

Importing this module imports triton; the capability gate (omnirun.kernels) offers it only where triton runs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from omnirun.kernels.triton.modes import BIT_EXACT_LAUNCH

_BLOCK = 4096


@triton.jit(do_not_specialize=["vocab"])
def _penalties_kernel(
    logits_ptr,
    out_ptr,
    counts_ptr,
    prompt_ptr,
    rows_ptr,
    repetition_ptr,
    frequency_ptr,
    presence_ptr,
    vocab,
    logits_stride,
    counts_stride,
    prompt_stride,
    HAS_PROMPT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    offsets = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < vocab
    row = tl.load(rows_ptr + b)
    x = tl.load(logits_ptr + b * logits_stride + offsets, mask=mask, other=0.0).to(tl.float32)
    counted = tl.load(counts_ptr + row * counts_stride + offsets, mask=mask, other=0)
    in_output = counted > 0
    seen = in_output
    if HAS_PROMPT:
        seen = seen | (tl.load(prompt_ptr + row * prompt_stride + offsets, mask=mask, other=0) != 0)
    rep = tl.load(repetition_ptr + b)
    x = tl.where(seen, tl.where(x > 0, tl.div_rn(x, rep), x * rep), x)
    x = x - tl.load(frequency_ptr + b) * counted.to(tl.float32)
    x = x - tl.load(presence_ptr + b) * in_output.to(tl.float32)
    tl.store(out_ptr + b * vocab + offsets, x, mask=mask)


def apply_penalties(
    logits: torch.Tensor,
    counts: torch.Tensor,
    prompt_seen: torch.Tensor | None,
    rows: torch.Tensor,
    repetition: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
) -> torch.Tensor:
    """See omnirun.sampling.adjust.apply_penalties (the reference): the same result, in one launch."""
    batch, vocab = logits.shape
    out = torch.empty(batch, vocab, dtype=torch.float32, device=logits.device)
    if batch == 0:
        return out
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    counts = counts.contiguous()
    # bool as uint8: the same bytes, and a pointer type every triton backend loads
    prompt = prompt_seen.contiguous().view(torch.uint8) if prompt_seen is not None else counts
    _penalties_kernel[(batch, triton.cdiv(vocab, _BLOCK))](
        logits,
        out,
        counts,
        prompt,
        rows,
        repetition,
        frequency,
        presence,
        vocab,
        logits.stride(0),
        counts.stride(0),
        prompt.stride(0),
        HAS_PROMPT=prompt_seen is not None,
        BLOCK=_BLOCK,
        num_warps=8,
        **BIT_EXACT_LAUNCH,
    )
    return out
