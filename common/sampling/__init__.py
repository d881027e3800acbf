"""Sampling: per-request parameters and the batched sampler that turns logits into next tokens."""

from __future__ import annotations

from omnirun.sampling.adjust import LogitAdjustments, TokenHistory
from omnirun.sampling.params import SamplingParams
from omnirun.sampling.sampler import SampleOutput, Sampler, SamplingBatch

__all__ = [
    "LogitAdjustments",
    "SampleOutput",
    "Sampler",
    "SamplingBatch",
    "SamplingParams",
    "TokenHistory",
]
