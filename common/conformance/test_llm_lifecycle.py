"""LLM lifecycle on the lane's device: close() gives the device memory back, a runner still open is named when the
next one finds no room, a failed step leaves the LLM usable, a closed LLM says so."""

from __future__ import annotations

import gc

import pytest

from omnirun.engine import LLM
from omnirun.errors import EngineClosedError, EngineStepError, KVPoolTooSmallError
from omnirun.memory import PagedKVCache
from omnirun.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
# A cap above any device's memory: the pool is then what the memory probe allows, not what the running limit
# can fill (or the CPU's default size), so that a runner left open leaves no room for the next.
WHOLE_MEMORY = {"max_total_tokens": 1 << 40}


def test_llms_in_a_row_each_get_the_whole_kv_pool(platform):
    """Five LLMs sized by the platform's memory probe (WHOLE_MEMORY), one after another, each closed: every one gets
    the pool the first got, and the probe shows the memory back after each close()."""
    gc.collect()
    free_at_start = platform.memory_info()[0]
    pools, outputs = [], []
    for _ in range(5):
        with LLM(device=platform.name, dtype="float32", **WHOLE_MEMORY) as llm:
            pools.append(llm.runner.kv.total_tokens)
            pool_bytes = _pool_bytes(llm)
            outputs.append(llm.generate("Hello", GREEDY, use_tqdm=False)[0].token_ids)
            assert platform.memory_info()[0] < free_at_start - 0.5 * pool_bytes
        assert llm.closed
        # (the host's free memory also moves with other processes: compare loosely, against a pool of gigabytes)
        assert platform.memory_info()[0] > free_at_start - 0.05 * pool_bytes
    assert all(abs(p - pools[0]) <= 0.05 * pools[0] for p in pools), pools
    assert all(o == outputs[0] for o in outputs)


def _pool_bytes(llm: LLM) -> int:
    shape = llm.runner.shape
    per_token = PagedKVCache.bytes_per_token(
        shape.num_layers, shape.num_kv_heads, shape.head_dim, llm.runner.kv_cache_dtype
    )
    return llm.runner.kv.total_tokens * per_token


def test_a_runner_left_open_is_named_when_the_next_finds_no_room(platform):
    first = LLM(device=platform.name, **WHOLE_MEMORY)
    try:
        with pytest.raises(KVPoolTooSmallError, match=r"other runner\(s\) of this process still hold .*close\(\)"):
            LLM(device=platform.name, **WHOLE_MEMORY)
    finally:
        first.close()
    with LLM(device=platform.name) as second:  # and once closed, the memory is there again
        assert second.runner.kv.total_tokens > 0


def test_dropping_an_llm_releases_it(platform):
    llm = LLM(device=platform.name)
    thread = llm._loop._thread
    del llm
    gc.collect()
    thread.join(timeout=30)
    assert not thread.is_alive(), "the engine thread must stop when its LLM is collected"
    with LLM(device=platform.name) as again:
        assert again.runner.kv.total_tokens > 0


def test_a_closed_llm_refuses_work_and_close_is_idempotent(platform):
    llm = LLM(device=platform.name, max_total_tokens=4096)
    llm.close()
    llm.close()
    for call in (lambda: llm.generate("Hello"), lambda: llm.stream("Hello"), llm.kv_usage):
        with pytest.raises(EngineClosedError, match="closed: create a new one"):
            call()


def test_a_failed_step_ends_its_requests_and_the_llm_goes_on(platform):
    with LLM(device=platform.name, max_total_tokens=4096, dtype="float32") as llm:
        expected = llm.generate(["Hello", "KV"], GREEDY, use_tqdm=False)
        forward = llm.runner.forward
        calls = {"n": 0}

        def failing_forward(batch):
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("injected device failure")
            return forward(batch)

        llm.runner.forward = failing_forward
        with pytest.raises(EngineStepError, match="injected device failure"):
            llm.generate(["Hello", "KV"], GREEDY, use_tqdm=False)
        usage = llm.kv_usage()
        assert usage.pages_free == usage.pages_total and usage.rows_free == usage.rows_total
        assert [o.token_ids for o in llm.generate(["Hello", "KV"], GREEDY, use_tqdm=False)] == [
            o.token_ids for o in expected
        ]
