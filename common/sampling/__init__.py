"""Sampling: per-request parameters and the batched sampler that turns logits into next tokens."""

from __future__ import annotations

from omnirun.sampling.params import SamplingParams
from omnirun.sampling.sampler import SampleOutput, Sampler, SamplingBatch, generator_seed

__all__ = ["SampleOutput", "Sampler", "SamplingBatch", "SamplingParams", "generator_seed"]
