"""torch_npu's fused top-k/top-p filter (aclnnApplyTopKTopP, Atlas A2/A3) inside omnirun's `sample` op.

`torch_npu.npu_top_k_top_p(logits, p, k)` (positional order p, then k; p in the logits' dtype, k int32 in
[1, 1024]: vllm-ascend `sample/sampler.py`, SGLang's npu sampler) returns the logits with what top-k and then top-p
leave out set to -inf, computed as the CANN doc `aclnnApplyTopKTopP.md` gives it: an ascending stable sort, the
k-th largest value as the top-k cut, then the ascending cumulative probabilities, dropping what sums to at most
1 - p. It needs a k for every row, so batches with a sampled row without top-k (or above 1024) take the reference.

The doc's top-p cut falls between positions of the sort, so of a tie at the cut it may keep some and not others;
the reference keeps a tie whole (omnirun.sampling.reference). Keeping every token at least as large as the
smallest one the op kept restores that. Temperature before the filter, min-p and the draw (the exponential race
with each row's key) are the reference's, so a seeded row draws the reference's token.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from omnirun.sampling import reference

ASCEND_TOP_K_MAX = 1024  # aclnnApplyTopKTopP's largest k
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def ascend_sample(torch_npu: Any) -> Callable[[torch.Tensor, Any], torch.Tensor]:
    def sample(logits: torch.Tensor, batch: Any) -> torch.Tensor:
        if not (batch.every_top_k and batch.max_top_k <= ASCEND_TOP_K_MAX) or logits.dtype not in _DTYPES:
            return reference.sample(logits, batch)
        x = reference.scaled_logits(logits, batch)
        # Greedy rows carry the vocabulary as their k: their draw is thrown away, any k in range will do.
        k = batch.top_ks.clamp(max=ASCEND_TOP_K_MAX).to(torch.int32)
        kept = torch_npu.npu_top_k_top_p(x, batch.top_ps.to(x.dtype), k)
        smallest = torch.where(torch.isfinite(kept), kept, float("inf")).amin(dim=-1, keepdim=True)
        x = x.masked_fill(x < smallest, float("-inf"))
        return reference.race(reference.probs_after_min_p(x, batch), batch)

    return sample
