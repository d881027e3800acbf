"""Logit adjustments before sampling: repetition, frequency and presence penalties, logit bias, min_tokens.

Built once per batch, and only when some request of the batch asks for one (`SamplingParams.adjusts_logits`),
from host tensors copied without a sync. The penalties run as the op table's `apply_penalties` (one pass over the
[B, V] logits in a platform's kernel; `apply_penalties` below is the reference), the bias and min_tokens as two
indexed writes. The order is vLLM's: repetition penalty, then frequency and presence penalties, then the logit
bias, then min_tokens' mask.

- repetition_penalty p (HF, vLLM): a token seen in the prompt or the output has its logit divided by p when
  positive and multiplied by p otherwise.
- frequency_penalty f, presence_penalty r (OpenAI): logit -= f * count_in_output + r * (count_in_output > 0).
- logit_bias: added to the named tokens' logits.
- min_tokens m: while fewer than m tokens were generated, EOS and the request's stop_token_ids get -inf.

The penalties read per-request token counts. The engine keeps them on the device from step to step
(omnirun.sampling.token_counts, passed as `TokenHistory.kept`); without them they are counted here from the host's
token lists. With overlap scheduling a request's newest token may still be on the device (not in its host-side
output ids): `TokenHistory.pending` carries it there, and it is counted without a sync."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from omnirun.errors import SamplingParamsError
from omnirun.host_to_device import to_device
from omnirun.sampling.params import SamplingParams


@dataclass
class KeptCounts:
    """Token counts kept on the device from step to step (omnirun.sampling.token_counts): batch row i reads row
    rows[i] of `counts` and `prompt_seen`. Its rows already hold every sampled token, pending ones included."""

    counts: torch.Tensor  # [R, V] int32: occurrences in the output
    prompt_seen: torch.Tensor | None  # [R, V] bool: in the prompt (None: no row of the batch has a repetition penalty)
    rows: torch.Tensor  # [B] int64


@dataclass
class TokenHistory:
    """What the adjustments need to know of each request of a batch, in row order."""

    prompt_ids: Sequence[Sequence[int]]
    output_ids: Sequence[Sequence[int]]  # output tokens the host has
    pending: torch.Tensor | None = None  # [B] int64 on the logits' device: a token not on the host yet, -1 if none
    eos_token_ids: Sequence[int] = ()  # what min_tokens holds back, besides each request's stop_token_ids
    kept: KeptCounts | None = None  # the penalties read these instead of counting prompt_ids and output_ids


def apply_penalties(
    logits: torch.Tensor,
    counts: torch.Tensor,
    prompt_seen: torch.Tensor | None,
    rows: torch.Tensor,
    repetition: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
) -> torch.Tensor:
    """The op table's `apply_penalties` reference: the repetition, frequency and presence penalties of batch row i
    from row rows[i] of `counts` [R, V] int32 (occurrences in the output) and `prompt_seen` [R, V] bool (None: no
    row has a repetition penalty), as a new float32 [B, V] tensor. repetition, frequency, presence: [B] float32
    (1, 0 and 0 where off: a row with all three off comes out as its logits)."""
    x = logits.float()
    counted = counts[rows]
    in_output = counted > 0
    seen = in_output if prompt_seen is None else in_output | prompt_seen[rows]
    rep = repetition[:, None]
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    return x - frequency[:, None] * counted - presence[:, None] * in_output


@dataclass
class LogitAdjustments:
    counts: torch.Tensor | None  # [R, V] int32: occurrences in the output (None: no penalized row)
    prompt_seen: torch.Tensor | None  # [R, V] bool: in the prompt (rows with a repetition penalty only)
    rows: torch.Tensor | None  # [B] int64: the row of counts/prompt_seen each batch row reads
    repetition: torch.Tensor  # [B] float32, 1 where off
    frequency: torch.Tensor  # [B] float32
    presence: torch.Tensor  # [B] float32
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
        counts = prompt_seen = rows = None
        if history.kept is not None:
            counts, prompt_seen, rows = history.kept.counts, history.kept.prompt_seen, history.kept.rows
        elif any(p.penalized for p in params):
            counts, prompt_seen = _counted(params, history, vocab_size, device)
            rows = torch.arange(len(params), device=device)
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
        penalties = to_device(
            [
                [p.repetition_penalty for p in params],
                [p.frequency_penalty for p in params],
                [p.presence_penalty for p in params],
            ],
            torch.float32,
            device,
        )
        return cls(
            counts=counts,
            prompt_seen=prompt_seen,
            rows=rows,
            repetition=penalties[0],
            frequency=penalties[1],
            presence=penalties[2],
            bias=bias,
            banned=banned,
        )

    def apply(self, logits: torch.Tensor, penalties: Callable[..., torch.Tensor] = apply_penalties) -> torch.Tensor:
        """The adjusted logits, as a new float32 tensor (`logits` is left as it is); `penalties` is the op table's
        `apply_penalties`."""
        if self.counts is None:
            x = logits.to(torch.float32, copy=True)
        else:
            args = (self.counts, self.prompt_seen, self.rows, self.repetition, self.frequency, self.presence)
            x = penalties(logits, *args)
        if self.bias is not None:
            x.index_put_(self.bias[:2], self.bias[2], accumulate=True)
        if self.banned is not None:
            x.index_put_(self.banned, torch.full((), float("-inf"), device=x.device))
        return x


def _counted(
    params: Sequence[SamplingParams], history: TokenHistory, vocab_size: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The penalties' [B, V] counts and prompt marks of one batch, counted from the host's token lists."""
    rows = len(params)
    counts = torch.zeros(rows, vocab_size, dtype=torch.int32, device=device)
    penalized = [i for i, p in enumerate(params) if p.penalized]
    put(counts, penalized, [history.output_ids[i] for i in penalized], 1, device, accumulate=True)
    if history.pending is not None:
        pending = history.pending.to(device=device, dtype=torch.int64)
        counts.scatter_add_(1, pending.clamp(min=0)[:, None], (pending >= 0).to(torch.int32)[:, None])
    prompt_seen = None
    repeated = [i for i in penalized if params[i].repetition_penalty != 1]
    if repeated:
        prompt_seen = torch.zeros(rows, vocab_size, dtype=torch.bool, device=device)
        put(prompt_seen, repeated, [history.prompt_ids[i] for i in repeated], True, device)
    return counts, prompt_seen


def put(
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
