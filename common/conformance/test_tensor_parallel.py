"""Tensor parallelism on the device under test: the model split over two ranks (two devices, or one where the
platform binds several ranks to one device, as the CPU does) gives HF's greedy tokens, with the device's graphs and its
collectives inside them where it has them."""

from __future__ import annotations

import pytest

from omnirun.engine import LLM
from omnirun.platform import Platform
from omnirun.sampling import SamplingParams
from omnirun.testing import hf_greedy

PROMPTS = [[5, 17, 42, 9, 100, 3], [11, 12, 13], [200, 7, 7, 1, 90, 45, 33, 2, 8]]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # GQA with llama3 rope; q/k norm with tied embeddings
def test_tp2_greedy_tokens_equal_hf(platform, device_name, tiny_checkpoints, arch):
    # Each rank takes a device of its own, unless the platform binds several ranks to one (Platform.bind_rank).
    shares_devices = type(platform).bind_rank is not Platform.bind_rank
    if not shares_devices and platform.device_count() < 2:
        pytest.skip(f"{device_name} shows {platform.device_count()} device(s): tensor parallelism over 2 needs two")
    checkpoint = tiny_checkpoints[arch]
    params = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    # The sharded copy: each rank reads its slices of tensors spread over several files.
    with LLM(str(checkpoint.sharded), device=device_name, tp_size=2, dtype="float32", progress=False) as llm:
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.token_ids for o in outputs] == [hf_greedy(checkpoint.hf_model, p, 8) for p in PROMPTS]
