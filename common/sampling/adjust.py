"""Logit adjustments before sampling: repetition, frequency and presence penalties, logit bias, min_tokens.

Built once per batch, and only when some request of the batch asks for one (`SamplingParams.adjusts_logits`),
from host tensors copied without a sync; the math then runs as a few batched tensor ops over the whole [B, V]
logits. The order is vLLM's: repetition
penalty, then frequency and presence penalties, then the logit bias, then min_tokens' mask.

- repetition_penalty p (HF, vLLM): a token seen in the prompt or the output has its logit divided by p when
  positive and multiplied by p otherwise.
- frequency_penalty f, presence_penalty r (OpenAI): logit -= f * count_in_output + r * (count_in_output > 0).
- logit_bias: added to the named tokens' logits.
- min_tokens m: while fewer than m tokens were generated, EOS and the request's stop_token_ids get -inf.

With overlap scheduling a request's newest token may still be on the device (not in its host-side output ids):
`TokenHistory.pending` carries it there, and it is counted without a sync.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from omnirun.errors import SamplingParamsError
from omnirun.host_to_device import to_device
from omnirun.sampling.params import SamplingParams


@dataclass
class TokenHistory:
    """What the adjustments need to know of each request of a batch, in row order."""

    prompt_ids: Sequence[Sequence[int]]
    output_ids: Sequence[Sequence[int]]  # output tokens the host has
    pending: torch.Tensor | None = None  # [B] int64 on the logits' device: a token not on the host yet, -1 if none
    eos_token_ids: Sequence[int] = ()  # what min_tokens holds back, besides each request's stop_token_ids


@dataclass
class LogitAdjustments:
    counts: torch.Tensor | None  # [B, V] float32: occurrences in the output (penalized rows only)
    prompt_seen: torch.Tensor | None  # [B, V] bool: in the prompt (rows with a repetition penalty only)
    repetition: torch.Tensor  # [B, 1] float32, 1 where off
    frequency: torch.Tensor  # [B, 1] float32
    presence: torch.Tensor  # [B, 1] float32
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (rows, token ids, values)
    banned: tuple[torch.Tensor, torch.Tensor] | None  # (rows, token ids) set to -inf (min_tokens)

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        token_index: Sequence[int],
        history: TokenHistory | None,
        vocab_size: int,
        device: torch.device | str,
    ) -> LogitAdjustments:
        """token_index[i] is the number of tokens request i generated before this one (what min_tokens counts)."""
        if history is None:
            if any(p.penalized for p in params):
                raise SamplingParamsError(
                    "presence/frequency/repetition penalties need each request's tokens: pass a TokenHistory"
                )
            history = TokenHistory(prompt_ids=[[]] * len(params), output_ids=[[]] * len(params))
        rows = len(params)
        counts = prompt_seen = None
        if any(p.penalized for p in params):
            counts = torch.zeros(rows, vocab_size, dtype=torch.float32, device=device)
            penalized = [i for i, p in enumerate(params) if p.penalized]
            _put(counts, penalized, [history.output_ids[i] for i in penalized], 1.0, device, accumulate=True)
            if history.pending is not None:
                pending = history.pending.to(device=device, dtype=torch.int64)
                counts.scatter_add_(1, pending.clamp(min=0)[:, None], (pending >= 0).float()[:, None])
            repeated = [i for i in penalized if params[i].repetition_penalty != 1]
            if repeated:
                prompt_seen = torch.zeros(rows, vocab_size, dtype=torch.bool, device=device)
                _put(prompt_seen, repeated, [history.prompt_ids[i] for i in repeated], True, device)
        bias = None
        biased = [i for i, p in enumerate(params) if p.logit_bias]
        if biased:
            items = [(i, t, v) for i in biased for t, v in params[i].logit_bias.items()]
            bias = (
                to_device([i for i, _, _ in items], torch.int64, device),
                to_device([t for _, t, _ in items], torch.int64, device),
                to_device([v for _, _, v in items], torch.float32, device),
            )
        banned = None
        held = [i for i, p in enumerate(params) if token_index[i] < p.min_tokens]
        if held:
            stops = [sorted(set(history.eos_token_ids) | set(params[i].stop_token_ids)) for i in held]
            pairs = [(i, t) for i, ids in zip(held, stops, strict=True) for t in ids if t < vocab_size]
            if pairs:
                banned = (
                    to_device([i for i, _ in pairs], torch.int64, device),
                    to_device([t for _, t in pairs], torch.int64, device),
                )
        return cls(
            counts=counts,
            prompt_seen=prompt_seen,
            repetition=to_device([[p.repetition_penalty] for p in params], torch.float32, device),
            frequency=to_device([[p.frequency_penalty] for p in params], torch.float32, device),
            presence=to_device([[p.presence_penalty] for p in params], torch.float32, device),
            bias=bias,
            banned=banned,
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The adjusted logits, as a new float32 tensor (`logits` is left as it is)."""
        x = logits.to(torch.float32, copy=True)
        if self.counts is not None:
            in_output = self.counts > 0
            if self.prompt_seen is not None:
                seen = in_output | self.prompt_seen
                x = torch.where(seen, torch.where(x > 0, x / self.repetition, x * self.repetition), x)
            x = x - self.frequency * self.counts - self.presence * in_output.float()
        if self.bias is not None:
            x.index_put_(self.bias[:2], self.bias[2], accumulate=True)
        if self.banned is not None:
            x.index_put_(self.banned, torch.full((), float("-inf"), device=x.device))
        return x


def _put(
    target: torch.Tensor,
    rows: list[int],
    ids: list[Sequence[int]],
    value: float | bool,
    device: torch.device | str,
    *,
    accumulate: bool = False,
) -> None:
    """target[rows[k], ids[k][j]] = value (or += value) for every k, j, in one indexed write."""
    flat_rows = [r for r, row_ids in zip(rows, ids, strict=True) for _ in row_ids]
    if not flat_rows:
        return
    index = (
        to_device(flat_rows, torch.int64, device),
        to_device([t for row_ids in ids for t in row_ids], torch.int64, device),
    )
    target.index_put_(index, torch.full((len(flat_rows),), value, dtype=target.dtype, device=device), accumulate)
