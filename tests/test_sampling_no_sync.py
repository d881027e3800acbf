"""Sampling builds its per-request tensors on the host and copies them with non_blocking=True: `torch.tensor(data,
device=...)` would synchronise the device's stream (on CUDA a cudaStreamSynchronize after the copy), making the host
wait for the forward pass just launched at every sampled step. The cuda lane checks the real thing with
torch.cuda's sync debug mode (devices/cuda/tests/test_cuda_sampling_sync.py)."""

from __future__ import annotations

import torch

from omnirun.sampling import Sampler, SamplingBatch, SamplingParams, TokenHistory

# One request per option the sampler turns into tensors: temperature, top-k, top-p, min-p, a seed, logprobs, the
# penalties, a logit bias and min_tokens.
PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, seed=3, logprobs=2),
    SamplingParams(temperature=1.0, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2),
    SamplingParams(temperature=1.0, logit_bias={4: 2.0, 9: -1.0}, min_tokens=3, stop_token_ids=[7]),
]


def test_sampling_never_creates_a_tensor_directly_on_a_device(monkeypatch):
    made_on_a_device = []
    plain = torch.tensor

    def tensor(*args, **kwargs):
        if kwargs.get("device") is not None:
            made_on_a_device.append(kwargs["device"])
        return plain(*args, **kwargs)

    monkeypatch.setattr(torch, "tensor", tensor)
    history = TokenHistory(
        prompt_ids=[[1, 2], [3], [4, 4, 5], [6]],
        output_ids=[[], [8], [9, 9], [1]],
        pending=plain([-1, 2, -1, 3]),
        eos_token_ids=[0],
    )
    batch = SamplingBatch.build(PARAMS, [0, 1, 2, 1], "cpu", vocab_size=16, history=history)
    out = Sampler()(torch.randn(4, 16), batch)
    assert out.token_ids.shape == (4,) and batch.adjustments is not None and batch.keys is not None
    assert made_on_a_device == [], "a per-request tensor was made with device=: a stream sync on CUDA"
