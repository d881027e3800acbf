"""Turn a batch of logits into next tokens: greedy, temperature, top-k, top-p, min-p, seeded, with logprobs.

The sampler never syncs with the host and never calls `torch.multinomial`: it samples with the exponential race
(`argmax(probs / q)`, q ~ Exponential(1)), which picks token i with probability probs[i] / sum(probs), needs no
renormalisation after filtering and runs as one vectorised op over the batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from omnirun.errors import SamplingParamsError
from omnirun.host_to_device import to_device
from omnirun.layers import native_ops
from omnirun.sampling.adjust import LogitAdjustments, TokenHistory
from omnirun.sampling.params import SamplingParams

_MASK64 = (1 << 64) - 1
# exponential_ can return exactly 0; clamping keeps 0 / q == 0 for filtered tokens instead of NaN (argmax picks NaN).
_Q_MIN = torch.finfo(torch.float32).tiny


def generator_seed(seed: int, token_index: int) -> int:
    """A 64-bit generator seed for output token `token_index` of a request seeded with `seed` (splitmix64 mix).

    Mixing both numbers means consecutive tokens and neighbouring seeds get unrelated random streams.
    """
    x = (seed * 0x9E3779B97F4A7C15 + token_index + 0x632BE59BD9B4E019) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


@dataclass
class SamplingBatch:
    """The sampling parameters of one batch as tensors on the logits' device, built once per batch.

    Greedy rows carry temperature 1 (they never use it; it keeps the division safe). `seeds` maps a row to its
    generator seed and stays on the host, because `torch.Generator.manual_seed` takes a Python int.
    """

    temperatures: torch.Tensor  # [B] float32
    top_ps: torch.Tensor  # [B] float32, 1 where off
    top_ks: torch.Tensor  # [B] int64, vocab size (or larger) where off
    min_ps: torch.Tensor  # [B] float32, 0 where off
    greedy: torch.Tensor  # [B] bool
    seeds: dict[int, int]  # row -> generator seed, seeded non-greedy rows only
    all_greedy: bool
    any_top_p: bool
    any_top_k: bool
    any_min_p: bool
    max_logprobs: int  # largest top-n requested (0: chosen token only), -1 when nobody wants logprobs
    adjustments: LogitAdjustments | None = None  # penalties, logit bias, min_tokens (None: no request uses any)

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
        max_logprobs = max((p.logprobs for p in params if p.logprobs is not None), default=-1)
        seeds = {
            row: generator_seed(p.seed, idx)
            for row, (p, idx, g) in enumerate(zip(params, token_index, greedy, strict=True))
            if p.seed is not None and not g
        }
        adjustments = None
        if any(p.adjusts_logits for p in params):
            if vocab_size is None:
                raise SamplingParamsError("penalties, logit_bias and min_tokens need SamplingBatch.build(vocab_size=)")
            adjustments = LogitAdjustments.build(params, token_index, history, vocab_size, device)
        return cls(  # each built on the host and copied without a sync (see omnirun.host_to_device)
            temperatures=to_device(temperatures, torch.float32, device),
            top_ps=to_device([p.top_p for p in params], torch.float32, device),
            top_ks=to_device([p.top_k if p.top_k > 0 else k_off for p in params], torch.int64, device),
            min_ps=to_device([p.min_p for p in params], torch.float32, device),
            greedy=to_device(greedy, torch.bool, device),
            seeds=seeds,
            all_greedy=not sampled,
            any_top_p=any(p.top_p < 1 for p in sampled),
            any_top_k=any(p.top_k > 0 for p in sampled),
            any_min_p=any(p.min_p > 0 for p in sampled),
            max_logprobs=max_logprobs,
            adjustments=adjustments,
        )


@dataclass
class SampleOutput:
    """The sampled tokens and, when asked for, their logprobs (of the raw logits, before temperature/filtering)."""

    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None = None  # [B] float32, logprob of the chosen token
    top_logprob_ids: torch.Tensor | None = None  # [B, n] int64, n = largest top-n requested; callers slice per row
    top_logprobs: torch.Tensor | None = None  # [B, n] float32, sorted descending


class Sampler:
    """Samples one token per row of a [B, V] logits tensor according to a SamplingBatch."""

    def __init__(self, argmax: Callable[[torch.Tensor], torch.Tensor] = native_ops.argmax):
        # Greedy picks: the op table's argmax (a platform's one-launch kernel, else the torch reference).
        self.greedy = argmax

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SampleOutput:
        """Tokens from the logits after the batch's adjustments; logprobs stay those of the raw logits."""
        adjusted = logits if batch.adjustments is None else batch.adjustments.apply(logits)
        token_ids = self.greedy(adjusted)
        if not batch.all_greedy:
            probs = self._filtered_probs(adjusted, batch)
            sampled = (probs / self._exponentials(probs, batch)).argmax(dim=-1)
            token_ids = torch.where(batch.greedy, token_ids, sampled)
        return self._with_logprobs(logits, token_ids, batch.max_logprobs)

    @staticmethod
    def _filtered_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Probabilities after temperature, top-k, top-p and min-p; filtered tokens have probability 0.

        Rows are not renormalised: the exponential race does not need it.
        """
        x = logits.float()
        # Subtracting the row max first (softmax does not care) keeps a tiny temperature from overflowing to inf.
        x = (x - x.amax(dim=-1, keepdim=True)) / batch.temperatures.unsqueeze(-1)
        if batch.any_top_k or batch.any_top_p:
            x = _top_k_top_p(x, batch)
        probs = torch.softmax(x, dim=-1)
        if batch.any_min_p:
            p_max = probs.amax(dim=-1, keepdim=True)
            probs = probs.masked_fill(probs < batch.min_ps.unsqueeze(-1) * p_max, 0.0)
        return probs

    @staticmethod
    def _exponentials(probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """q ~ Exponential(1) per token: seeded rows from their own generator, the rest from the global RNG."""
        q = torch.empty_like(probs).exponential_()
        vocab = probs.shape[-1]
        for row, seed in batch.seeds.items():
            gen = torch.Generator(device=probs.device)
            gen.manual_seed(seed)
            # Drawn as a row of its own so the stream does not depend on the batch size or position.
            q[row] = torch.empty(vocab, dtype=q.dtype, device=q.device).exponential_(generator=gen)
        return q.clamp_(min=_Q_MIN)

    @staticmethod
    def _with_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, max_logprobs: int) -> SampleOutput:
        if max_logprobs < 0:
            return SampleOutput(token_ids=token_ids)
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        chosen = logprobs.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)
        if max_logprobs == 0:
            return SampleOutput(token_ids=token_ids, logprobs=chosen)
        n = min(max_logprobs, logprobs.shape[-1])
        top_values, top_ids = logprobs.topk(n, dim=-1, sorted=True)
        return SampleOutput(token_ids=token_ids, logprobs=chosen, top_logprob_ids=top_ids, top_logprobs=top_values)


def _top_k_top_p(x: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Set to -inf the scaled logits outside each row's top-k and then outside its nucleus (top-p).

    One descending sort serves both. Top-k keeps every token tied with the k-th. Top-p keeps the shortest
    sorted prefix whose probability reaches top_p, and always the most likely token.
    """
    vocab = x.shape[-1]
    # A stable sort orders ties by token id, so the nucleus cut does not depend on the batch around a row.
    sorted_x, order = x.sort(dim=-1, descending=True, stable=True)
    if batch.any_top_k:
        k = batch.top_ks.clamp(min=1, max=vocab).unsqueeze(-1)
        kth = sorted_x.gather(-1, k - 1)
        sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
    if batch.any_top_p:
        sorted_probs = torch.softmax(sorted_x, dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        top_p = batch.top_ps.unsqueeze(-1)
        # Rows with top_p == 1 are left alone: rounding in the cumsum must not drop their tail.
        outside = (mass_before >= top_p) & (top_p < 1)
        sorted_x = sorted_x.masked_fill(outside, float("-inf"))
    return torch.empty_like(x).scatter_(-1, order, sorted_x)
