"""The torch reference of the `sample` op: one token per row of [B, V] logits by temperature, top-k, top-p and
min-p, drawn with the exponential race (`argmax(probs / q)`, q ~ Exponential(1) from omnirun.sampling.counter_rng),
which picks token i with probability probs[i] / sum(probs), needs no renormalisation after filtering and never
waits for the host. A platform may offer a faster kernel of the same op (omnirun.kernels.triton.sample needs no sort).

Ties at a cut are kept whole: top-k keeps every token equal to the k-th (as HF does), and top-p keeps every token
equal to the last one its nucleus needs (a cut on the value, which a sort-free kernel finds), so a row's filter
depends on its logits alone, not on the order of equal values (HF and vLLM cut a tie at the sort's order).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from omnirun.sampling.counter_rng import exponentials

if TYPE_CHECKING:
    from omnirun.sampling.sampler import SamplingBatch


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """int64 [B]: each row's draw from its filtered distribution, with its key's random numbers."""
    return race(filtered_probs(logits, batch), batch)


def race(probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """int64 [B]: the exponential race over each row's (unnormalised) probabilities, with its key's numbers."""
    return (probs / exponentials(batch.keys, probs.shape[-1])).argmax(dim=-1)


def filtered_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Probabilities after temperature, top-k, top-p and min-p; filtered tokens have probability 0. Rows are not
    renormalised after min-p: the exponential race does not need it."""
    x = scaled_logits(logits, batch)
    if batch.any_top_k or batch.any_top_p:
        x = _top_k_top_p(x, batch)
    return probs_after_min_p(x, batch)


def scaled_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """float32 logits over each row's temperature. Subtracting the row max first (softmax does not care) keeps a
    tiny temperature from overflowing to inf."""
    x = logits.float()
    return (x - x.amax(dim=-1, keepdim=True)) / batch.temperatures.unsqueeze(-1)


def probs_after_min_p(x: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """softmax of the (top-k/top-p filtered) scaled logits, less the tokens under min_p × the row's largest."""
    probs = torch.softmax(x, dim=-1)
    if batch.any_min_p:
        p_max = probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < batch.min_ps.unsqueeze(-1) * p_max, 0.0)
    return probs


def _top_k_top_p(x: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Set to -inf the scaled logits outside each row's top-k and then outside its nucleus (top-p): the tokens
    below the value where the sorted probabilities first reach top_p (the most likely token always stays)."""
    vocab = x.shape[-1]
    sorted_x = x.sort(dim=-1, descending=True).values
    cut = torch.full_like(x[:, :1], float("-inf"))  # keep x >= cut
    if batch.any_top_k:
        k = batch.top_ks.clamp(min=1, max=vocab).unsqueeze(-1)
        cut = sorted_x.gather(-1, k - 1)
        sorted_x = sorted_x.masked_fill(sorted_x < cut, float("-inf"))
    if batch.any_top_p:
        sorted_probs = torch.softmax(sorted_x, dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        top_p = batch.top_ps.unsqueeze(-1)
        # The last token the nucleus needs: mass before it still short of top_p. Rows with top_p == 1 are left
        # alone, so that rounding in the cumsum cannot drop their tail.
        needed = ((mass_before < top_p).sum(dim=-1, keepdim=True)).clamp(min=1)
        nucleus = torch.where(top_p < 1, sorted_x.gather(-1, needed - 1), float("-inf"))
        cut = torch.maximum(cut, nucleus)
    return x.masked_fill(x < cut, float("-inf"))


# The reference serves a decode graph's sampler (omnirun.sampling.graph_form): a row's token depends on the row
# alone, not on which flags the batch sets; it lists no short list, so one sampler per graph (width 0) does.
sample.graph_widths = (0,)
