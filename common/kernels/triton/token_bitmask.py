"""The `apply_token_bitmask` op in Triton: one pass over the [B, V] logits, each program a block of one row, its
bits read from the row's int32 words (see omnirun.sampling.token_bitmask, the reference: the same values, exactly).

Importing this module imports triton; the capability gate (omnirun.kernels) offers it only where triton runs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 4096


@triton.jit(do_not_specialize=["vocab"])
def _bitmask_kernel(logits_ptr, bitmask_ptr, out_ptr, vocab, logits_stride, bitmask_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offsets = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < vocab
    words = tl.load(bitmask_ptr + row * bitmask_stride + offsets // 32, mask=inside, other=0)
    allowed = ((words >> (offsets % 32)) & 1) != 0
    logits = tl.load(logits_ptr + row * logits_stride + offsets, mask=inside, other=0.0)
    out = tl.where(allowed, logits, float("-inf")).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * logits_stride + offsets, out, mask=inside)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """See omnirun.sampling.token_bitmask.apply_token_bitmask."""
    logits, bitmask = logits.contiguous(), bitmask.contiguous()
    rows, vocab = logits.shape
    out = torch.empty_like(logits)
    if rows:
        _bitmask_kernel[(rows, triton.cdiv(vocab, _BLOCK))](
            logits, bitmask, out, vocab, logits.stride(0), bitmask.stride(0), BLOCK=_BLOCK
        )
    return out
