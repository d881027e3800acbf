"""Sampling on a real NVIDIA GPU queues its work without waiting for the device: torch.cuda's sync debug mode makes
every synchronising call (a blocking host-to-device copy, .item(), a boolean mask) an error. A sampled decode step
that synchronised would make the host wait for the forward pass just launched, undoing overlap scheduling."""

from __future__ import annotations

import pytest
import torch

from omnirun.sampling import Sampler, SamplingBatch, SamplingParams, TokenHistory

pytestmark = pytest.mark.device("cuda")

# One request per option the sampler turns into tensors (as tests/test_sampling_no_sync.py, which runs anywhere).
PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, seed=3, logprobs=2),
    SamplingParams(temperature=1.0, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2),
    SamplingParams(temperature=1.0, logit_bias={4: 2.0, 9: -1.0}, min_tokens=3, stop_token_ids=[7]),
]


def test_sampling_with_every_option_never_synchronises():
    logits = torch.randn(4, 16, device="cuda")
    history = TokenHistory(
        prompt_ids=[[1, 2], [3], [4, 4, 5], [6]],
        output_ids=[[], [8], [9, 9], [1]],
        pending=torch.tensor([-1, 2, -1, 3]).cuda(),
        eos_token_ids=[0],
    )
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        batch = SamplingBatch.build(PARAMS, [0, 1, 2, 1], logits.device, vocab_size=16, history=history)
        out = Sampler()(logits, batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    tokens = out.token_ids.tolist()
    assert tokens[0] == int(logits[0].argmax()) and tokens[3] not in (0, 7)  # greedy row; min_tokens holds EOS, 7
