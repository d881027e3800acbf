"""The prefix cache on the lane's device: requests that share cached pages (the device's attention backends reading
a prefix another request computed) give the tokens of the runs without the cache, and the pool drains whole."""

from __future__ import annotations

import random

import pytest

from omnirun.engine import Engine
from omnirun.sampling import SamplingParams
from omnirun.testing import make_runner


def _prompts(seed: int) -> list[list[int]]:
    """Turns of chats and a shared system prompt: each prompt begins with another's tokens."""
    rng = random.Random(seed)
    system = [rng.randrange(256) for _ in range(40)]
    prompts = [system + [rng.randrange(256) for _ in range(rng.randint(1, 12))] for _ in range(4)]
    return prompts + [p + [rng.randrange(256) for _ in range(20)] for p in prompts[:2]]


def _run(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    requests = [engine.add_request(p, params) for p in prompts]
    while engine.has_work:
        engine.step()
    return [r.output_ids for r in requests]


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_shared_prefixes_give_the_tokens_computed_without_the_cache(platform, tiny_checkpoints, page_size, overlap):
    runner = make_runner(platform, tiny_checkpoints["qwen2"].plain, page_size=page_size, max_total_tokens=512)
    params = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    prompts = _prompts(page_size)
    expected = _run(Engine(runner, prefix_caching=False, overlap_schedule=overlap), prompts, params)
    engine = Engine(runner, chunked_prefill_size=24, overlap_schedule=overlap)
    # twice: the second pass finds every prompt cached but its last token
    assert _run(engine, prompts, params) == expected and _run(engine, prompts, params) == expected
    assert engine.prefill_stats().cached_tokens > 0
    usage = engine.kv_usage()
    assert usage.pages_held == {} and usage.pages_free + usage.pages_cached == usage.pages_total
    assert usage.pages_leaked == 0
