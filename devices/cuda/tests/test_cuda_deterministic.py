"""Deterministic mode on a real NVIDIA GPU: the Triton batch-invariant matmul and attention, in CUDA graphs. One
prompt's tokens alone, inside a batch of 64, in 16-token chunks, after a cached prefix and eagerly: all the same."""

from __future__ import annotations

import random

import pytest
import torch

from omnirun import LLM, SamplingParams

pytestmark = pytest.mark.device("cuda")

NEW_TOKENS = 48


def _prompts(seed: int, count: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randrange(40, 200))] for _ in range(count)]


@pytest.fixture(scope="module")
def llm():
    with LLM(device="cuda", dtype="bfloat16", deterministic=True, max_total_tokens=65536) as llm:
        yield llm


def test_the_deterministic_parts_are_the_kernels(llm):
    from omnirun.kernels.triton.matmul import batch_invariant_linear

    runner = llm.runner
    assert runner.attention_choice == ("triton", "triton")
    assert runner.attention.num_splits == 1
    assert runner.ops.linear is batch_invariant_linear
    assert runner.graph_runner is not None and runner.graph_runner.graphs


def test_one_prompt_alone_and_inside_a_batch_of_64(llm):
    params = [SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS, ignore_eos=True)]
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    others = _prompts(1, 64)
    for prompt in _prompts(0, 4):
        for p in params + [seeded]:
            alone = llm.generate([prompt], p, use_tqdm=False)[0].token_ids
            batch = others[:20] + [prompt] + others[20:]
            inside = llm.generate(batch, p, use_tqdm=False)[20].token_ids
            assert inside == alone
            llm.generate([prompt[: len(prompt) // 2 + 3]], p, use_tqdm=False)  # caches an odd-length prefix
            assert llm.generate([prompt], p, use_tqdm=False)[0].token_ids == alone


def test_chunked_and_eager_give_the_graph_tokens(llm):
    params = SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    prompts = _prompts(2, 6)
    want = [llm.generate([p], params, use_tqdm=False)[0].token_ids for p in prompts]
    flags = dict(device="cuda", dtype="bfloat16", deterministic=True, max_total_tokens=32768)
    for extra in ({"chunked_prefill_size": 16, "disable_prefix_caching": True}, {"disable_graph": True}):
        with LLM(**flags, **extra) as other:
            got = [other.generate([p], params, use_tqdm=False)[0].token_ids for p in prompts]
        assert got == want, extra
    torch.cuda.synchronize()
