"""Turn a batch of logits into next tokens: greedy, temperature, top-k, top-p, min-p, seeded, with logprobs.

The sampler never syncs with the host. Greedy rows take the op table's `argmax`; sampled rows its `sample` (the
torch reference in omnirun.sampling.reference, or a platform's kernel), whose random numbers are a hash of each
row's key (omnirun.sampling.counter_rng): a seeded request's key is its seed and token index, any other row's a
draw of torch's global CPU RNG; the keys reach the device with the other parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from omnirun.errors import SamplingParamsError
from omnirun.host_to_device import to_device
from omnirun.layers import native_ops
from omnirun.sampling import adjust, reference, token_bitmask
from omnirun.sampling.adjust import LogitAdjustments, TokenHistory
from omnirun.sampling.counter_rng import row_key
from omnirun.sampling.params import SamplingParams

_INT64 = torch.iinfo(torch.int64)


@dataclass
class SamplingBatch:
    """The sampling parameters of one batch as tensors on the logits' device, built once per batch.

    Greedy rows carry temperature 1 (they never use it; it keeps the division safe).
    """

    temperatures: torch.Tensor  # [B] float32
    top_ps: torch.Tensor  # [B] float32, 1 where off
    top_ks: torch.Tensor  # [B] int64, vocab size (or larger) where off
    min_ps: torch.Tensor  # [B] float32, 0 where off
    greedy: torch.Tensor  # [B] bool
    keys: torch.Tensor | None  # [B] int64: each row's random key (counter_rng.row_key); None when all are greedy
    all_greedy: bool
    any_top_p: bool
    any_top_k: bool
    any_min_p: bool
    max_top_k: int  # the largest top-k of a sampled row (0: none has top-k on); a kernel sizes its short list by it
    every_top_k: bool  # every sampled row has top-k on (a kernel that needs a k per row may then run)
    any_top_p_alone: bool  # a sampled row has top-p and no top-k (a kernel may list candidates for its nucleus)
    max_logprobs: int  # largest top-n requested (0: chosen token only), -1 when nobody wants logprobs
    adjustments: LogitAdjustments | None = None  # penalties, logit bias, min_tokens (None: no request uses any)
    # int32 [B, ceil(V / 32)] on the device: each row's tokens a grammar allows next (None: no row is constrained)
    token_bitmask: torch.Tensor | None = None
    # The graph form (omnirun.sampling.graph_form): a decode graph's sampler sets every flag above, lists
    # `shortlist_width` logits per row, and tells a kernel with these [B] device tensors how long a list
    # (omnirun.sampling.shortlist) the same batch would have had eagerly, and whether top-p rows may cut their
    # nucleus in it. None: an eager batch, whose kernel sizes its list from the flags.
    shortlist_width: int | None = None
    shortlist_count: torch.Tensor | None = None  # [B] int64
    shortlist_nucleus: torch.Tensor | None = None  # [B] int64, 0 or 1

    @property
    def size(self) -> int:
        return self.temperatures.shape[0]

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        token_index: Sequence[int],
        device: torch.device | str,
        vocab_size: int | None = None,
        history: TokenHistory | None = None,
        token_bitmask: torch.Tensor | None = None,
    ) -> SamplingBatch:
        """Collect `params` into tensors on `device`.

        token_index[i] is the index of the output token request i is sampling now (0 for its first new token);
        it makes seeded sampling reproducible. vocab_size, when given, is stored for rows with top-k off
        (otherwise the int64 maximum; the sampler clamps to the logits' vocabulary either way). history (each
        request's prompt and output ids, EOS ids) is what penalties and min_tokens need; they need vocab_size too.
        """
        if len(token_index) != len(params):
            raise SamplingParamsError(
                f"SamplingBatch.build got {len(params)} params but {len(token_index)} token indices: "
                "pass one token index per request"
            )
        k_off = vocab_size if vocab_size is not None else torch.iinfo(torch.int64).max
        greedy = [p.greedy for p in params]
        temperatures = [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)]
        sampled = [p for p, g in zip(params, greedy, strict=True) if not g]
        adjustments = None
        if any(p.adjusts_logits for p in params):
            if vocab_size is None:
                raise SamplingParamsError("penalties, logit_bias and min_tokens need SamplingBatch.build(vocab_size=)")
            adjustments = LogitAdjustments.build(params, token_index, history, vocab_size, device)
        # Built on the host and copied without a sync (see omnirun.host_to_device), in three copies: one per dtype.
        floats = to_device([temperatures, [p.top_p for p in params], [p.min_p for p in params]], torch.float32, device)
        top_ks = [p.top_k if p.top_k > 0 else k_off for p in params]
        ints = to_device([top_ks, random_keys(params, token_index)] if sampled else [top_ks], torch.int64, device)
        return cls(
            temperatures=floats[0],
            top_ps=floats[1],
            top_ks=ints[0],
            min_ps=floats[2],
            greedy=to_device(greedy, torch.bool, device),
            keys=ints[1] if sampled else None,
            adjustments=adjustments,
            token_bitmask=token_bitmask,
            **host_flags(params),
        )


def host_flags(params: Sequence[SamplingParams]) -> dict[str, bool | int]:
    """A SamplingBatch's host flags for `params` (what chooses a kernel's variant and its short list)."""
    sampled = [p for p in params if not p.greedy]
    return {
        "all_greedy": not sampled,
        "any_top_p": any(p.top_p < 1 for p in sampled),
        "any_top_k": any(p.top_k > 0 for p in sampled),
        "any_min_p": any(p.min_p > 0 for p in sampled),
        "max_top_k": max((p.top_k for p in sampled if p.top_k > 0), default=0),
        "every_top_k": bool(sampled) and all(p.top_k > 0 for p in sampled),
        "any_top_p_alone": any(p.top_p < 1 and p.top_k <= 0 for p in sampled),
        "max_logprobs": max((p.logprobs for p in params if p.logprobs is not None), default=-1),
    }


@dataclass
class SampleOutput:
    """The sampled tokens and, when asked for, their logprobs (of the raw logits, before temperature/filtering)."""

    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None = None  # [B] float32, logprob of the chosen token
    top_logprob_ids: torch.Tensor | None = None  # [B, n] int64, n = largest top-n requested; callers slice per row
    top_logprobs: torch.Tensor | None = None  # [B, n] float32, sorted descending


class Sampler:
    """Samples one token per row of a [B, V] logits tensor according to a SamplingBatch."""

    def __init__(
        self,
        argmax: Callable[[torch.Tensor], torch.Tensor] = native_ops.argmax,
        sample: Callable[[torch.Tensor, SamplingBatch], torch.Tensor] = reference.sample,
        apply_penalties: Callable[..., torch.Tensor] = adjust.apply_penalties,
        apply_token_bitmask: Callable[..., torch.Tensor] = token_bitmask.apply_token_bitmask,
    ):
        # The op table's picks: a platform's kernels, else the torch references.
        self.greedy = argmax
        self.sample = sample
        self.apply_penalties = apply_penalties
        self.apply_token_bitmask = apply_token_bitmask

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SampleOutput:
        """Tokens from the logits after the batch's adjustments and grammars; logprobs stay those of the raw
        logits."""
        adjusted = logits if batch.adjustments is None else batch.adjustments.apply(logits, self.apply_penalties)
        if batch.token_bitmask is not None:
            adjusted = self.apply_token_bitmask(adjusted, batch.token_bitmask)
        token_ids = self.greedy(adjusted)
        if not batch.all_greedy:
            token_ids = torch.where(batch.greedy, token_ids, self.sample(adjusted, batch))
        return self._with_logprobs(logits, token_ids, batch.max_logprobs)

    @staticmethod
    def _with_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, max_logprobs: int) -> SampleOutput:
        if max_logprobs < 0:
            return SampleOutput(token_ids=token_ids)
        chosen, top_ids, top_values = token_logprobs(logits, token_ids, max_logprobs)
        return SampleOutput(token_ids=token_ids, logprobs=chosen, top_logprob_ids=top_ids, top_logprobs=top_values)


# Top logprobs are listed this many at least (then cut to what the batch asks): a decode graph lists as many, and
# the same top-k call in both puts tied values in the same order.
LISTED_TOP_LOGPROBS = 20


def token_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, max_logprobs: int
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The chosen tokens' logprobs [B] (of the raw logits) and, for max_logprobs > 0, the top max_logprobs ids and
    logprobs [B, n], sorted descending."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)
    if max_logprobs <= 0:
        return chosen, None, None
    vocab = logprobs.shape[-1]
    top_values, top_ids = logprobs.topk(min(max(max_logprobs, LISTED_TOP_LOGPROBS), vocab), dim=-1, sorted=True)
    n = min(max_logprobs, vocab)
    return chosen, top_ids[:, :n], top_values[:, :n]


def random_keys(params: Sequence[SamplingParams], token_index: Sequence[int]) -> list[int]:
    """Each row's random key, made on the host: a seeded request's from its seed and token index, any other row's
    a draw of torch's global (CPU) RNG, which torch.manual_seed seeds. No device work: one copy carries them."""
    unseeded = sum(p.seed is None for p in params)
    drawn = iter(torch.randint(_INT64.min, _INT64.max, (unseeded,), dtype=torch.int64).tolist() if unseeded else ())
    return [next(drawn) if p.seed is None else row_key(p.seed, i) for p, i in zip(params, token_index, strict=True)]
