"""Prompt logprobs: each prompt token's logprob (and the top n at its position) from the logits of the prefill.

A step computes the logits of every new token of the requests that want them (ScheduledStep.every_logit;
omnirun.batch.logit_counts gives each request's rows); the logits at position p score prompt token p + 1. Those
requests read no prefix from the prefix cache (Scheduler._admit), so every position is computed, chunk by chunk.
The values are taken on the device and copied to the host without waiting, like the sampled tokens, and written
into the request by position once the step is complete.
"""

from __future__ import annotations

import dataclasses

import torch

from omnirun.batch import logit_counts
from omnirun.engine.request import Request
from omnirun.engine.scheduler import ScheduledStep


@dataclasses.dataclass
class PromptLogprobs:
    """One request's prompt logprobs from one step, on their way to the host."""

    request: Request
    first: int  # the prompt position of the first value
    chosen: torch.Tensor  # [m] float32: the logprob of each prompt token
    top_ids: torch.Tensor | None  # [m, n] int64: the top n at each position (n = prompt_logprobs > 0)
    top_values: torch.Tensor | None

    def write(self) -> None:
        """Into the request, by position (call once the copies are complete)."""
        req, end = self.request, self.first + self.chosen.numel()
        req.prompt_logprobs[self.first : end] = self.chosen.tolist()
        if self.top_ids is not None:
            ids, values = self.top_ids.tolist(), self.top_values.tolist()
            pairs = [list(zip(i, v, strict=True)) for i, v in zip(ids, values, strict=True)]
            req.prompt_top_logprobs[self.first : end] = pairs


def logit_rows(step: ScheduledStep) -> list[int]:
    """Each request's rows in the step's logits: where its last token's (what it samples from) is."""
    counts = logit_counts(step.batch.extend_seq_lens_cpu.tolist(), step.every_logit)
    return torch.tensor(counts).cumsum(0).sub(1).tolist()


def prompt_logprobs(step: ScheduledStep, logits: torch.Tensor) -> list[PromptLogprobs]:
    """Queue the prompt logprobs of the step's requests that want them, and their copies to the host."""
    if step.every_logit is None:
        return []
    batch = step.batch
    news, starts = batch.extend_seq_lens_cpu.tolist(), batch.extend_prefix_lens_cpu.tolist()
    counts = logit_counts(news, step.every_logit)
    parts, row = [], 0
    for req, start, count, every in zip(step.requests, starts, counts, step.every_logit, strict=True):
        # Positions start .. start + count - 1 score tokens start + 1 ..: keep those that are prompt tokens.
        scored = min(count, len(req.prompt_ids) - 1 - start) if every else 0
        if scored > 0:
            logprobs = torch.log_softmax(logits[row : row + scored].float(), dim=-1)
            targets = torch.tensor(req.prompt_ids[start + 1 : start + 1 + scored], device=logits.device)
            chosen = logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
            n = req.params.prompt_logprobs
            top = logprobs.topk(n, dim=-1) if n else None
            ids, values = (top.indices, top.values) if top is not None else (None, None)
            host = [None if t is None else t.to("cpu", non_blocking=True) for t in (chosen, ids, values)]
            parts.append(PromptLogprobs(req, start + 1, *host))
        row += count
    return parts
