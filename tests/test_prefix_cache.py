"""The prefix cache in the engine: the same greedy tokens with and without it on random workloads with shared
prefixes, pages freed only when their last holder lets go, eviction before preemption, a repeated prompt computing
at most one page, prompts shared while still being prefilled, pending tokens kept out, the flag, the stats, and
TP=2 (the other rank writes shared prefixes' table entries from the step's batch).

The small embedded model on the cpu, float32; each runner is shared by the tests of a module-scoped fixture."""

from __future__ import annotations

import argparse
import collections
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from omnirun.assets.default_model import default_model_dir
from omnirun.cli_flags import add_runner_flags, llm_kwargs
from omnirun.config import RunnerConfig
from omnirun.engine import LLM
from omnirun.engine.engine import Engine
from omnirun.engine.request import Request
from omnirun.engine.scheduler import Scheduler
from omnirun.launch import start_runner
from omnirun.memory import KVMemory, PageAllocator, PagedKVCache, ReqToTokenPool
from omnirun.memory.radix_cache import RadixCache
from omnirun.sampling import SamplingParams

MODEL = default_model_dir()
FLAGS = dict(model=MODEL, device="cpu", dtype="float32", progress=False, seed=0)
CONTEXT = 128


@pytest.fixture(scope="module")
def tight_runners():
    """Pools of 128 tokens (page 1) and 160 (page 16): two or three requests at a time."""
    runners = {
        page: start_runner(RunnerConfig(**FLAGS, page_size=page, max_total_tokens=tokens, context_length=CONTEXT))
        for page, tokens in ((1, 128), (16, 160))
    }
    yield runners
    for runner in runners.values():
        runner.close()


@pytest.fixture(scope="module")
def roomy_runners():
    runners = {
        page: start_runner(RunnerConfig(**FLAGS, page_size=page, max_total_tokens=2048, context_length=256))
        for page in (1, 16)
    }
    yield runners
    for runner in runners.values():
        runner.close()


def check_pages(engine: Engine) -> None:
    """Every page's reference count is its holders (rows using it, plus the tree), and exactly the pages nobody
    holds are free: no page is freed while a request or the cache uses it."""
    kv = engine.runner.kv
    holders = collections.Counter()
    for req in engine.scheduler.running:
        holders.update(kv.pages_of(req.row))
    tree = engine.prefix_cache.pages() if engine.prefix_cache is not None else []
    assert len(set(tree)) == len(tree)
    holders.update(tree)
    pages = range(1, kv.allocator.num_pages + 1)
    assert kv.refcounts(pages) == [holders[p] for p in pages]
    assert kv.allocator.free_count == kv.allocator.num_pages - len(holders)


def drive(engine: Engine, prompts, params, *, check: bool = False) -> list[list[int]]:
    requests = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    while engine.has_work:
        engine.step()
        if check:
            check_pages(engine)
    return [r.output_ids for r in requests]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)


@st.composite
def prompt_trees(draw):
    """Prompts that branch off a few random stems at random points (a system prompt, turns of a chat)."""
    rng = random.Random(draw(st.integers(0, 2**32)))
    stems = [[rng.randrange(2, 512) for _ in range(48)] for _ in range(draw(st.integers(1, 3)))]
    prompts = []
    for _ in range(draw(st.integers(3, 8))):
        stem = rng.choice(stems)
        prompts.append(stem[: rng.randint(0, 48)] + [rng.randrange(2, 512) for _ in range(rng.randint(1, 16))])
    return prompts, [rng.randint(1, 12) for _ in prompts]


def test_greedy_tokens_are_the_same_with_and_without_the_cache_under_eviction_and_preemption(tight_runners):
    seen = collections.Counter()

    @settings(max_examples=25, deadline=None, derandomize=True, database=None)
    @given(
        tree=prompt_trees(),
        page=st.sampled_from([1, 16]),
        chunk=st.sampled_from([8, 64]),
        overlap=st.booleans(),
    )
    def run(tree, page, chunk, overlap):
        prompts, lengths = tree
        params = [greedy(n) for n in lengths]
        runner = tight_runners[page]
        plain = Engine(runner, prefix_caching=False, chunked_prefill_size=chunk, overlap_schedule=overlap)
        expected = drive(plain, prompts, params)
        engine = Engine(runner, chunked_prefill_size=chunk, overlap_schedule=overlap)
        assert drive(engine, prompts, params, check=True) == expected
        usage = engine.kv_usage()
        assert usage.pages_free + usage.pages_cached == usage.pages_total and usage.pages_leaked == 0
        seen["hits"] += engine.prefill_stats().cached_tokens > 0
        seen["evictions"] += engine.prefix_cache.evicted_pages > 0
        seen["preemptions"] += engine.scheduler.num_preemptions > 0
        seen[f"page {page}"] += 1

    run()
    assert seen["hits"] and seen["evictions"] and seen["preemptions"], seen
    assert seen["page 1"] and seen["page 16"], seen


def test_cached_pages_are_evicted_before_a_running_request_is_preempted(tight_runners):
    # All three start together (123 of 128 pages with the decode headroom); A finishes at once and its 61 pages
    # stay cached; B and C then need 60 more pages to decode: only A's cached pages can give them.
    rng = random.Random(3)
    prompts = [[rng.randrange(2, 512) for _ in range(n)] for n in (60, 30, 30)]
    params = [greedy(2), greedy(30), greedy(30)]
    runner = tight_runners[1]
    expected = drive(Engine(runner, prefix_caching=False), prompts, params)
    engine = Engine(runner)
    assert drive(engine, prompts, params, check=True) == expected
    assert engine.prefix_cache.evicted_pages > 0 and engine.scheduler.num_preemptions == 0


@pytest.mark.parametrize("page", [1, 16])
def test_a_second_request_with_the_same_200_token_prompt_prefills_at_most_one_page(roomy_runners, page):
    prompt = [random.Random(page).randrange(2, 512) for _ in range(200)]
    engine = Engine(roomy_runners[page])
    first = drive(engine, [prompt], [greedy(4)])
    before = engine.prefill_stats()
    second = engine.add_request(prompt, greedy(4))
    while engine.has_work:
        engine.step()
    after = engine.prefill_stats()
    assert second.output_ids == first[0]
    assert 1 <= after.computed_tokens - before.computed_tokens <= page
    assert second.cached_tokens == after.cached_tokens - before.cached_tokens >= 200 - page
    assert after.hit_rate > 0.4


def test_a_prompt_is_shared_while_it_is_still_being_prefilled(roomy_runners):
    prompt = [random.Random(5).randrange(2, 512) for _ in range(100)]
    expected = drive(Engine(roomy_runners[1], prefix_caching=False), [prompt], [greedy(4)])[0]
    engine = Engine(roomy_runners[1], chunked_prefill_size=32, overlap_schedule=False)
    first = engine.add_request(prompt, greedy(4))
    engine.step()  # its first 32 tokens are computed
    second = engine.add_request(prompt, greedy(4))
    while engine.has_work:
        engine.step()
    assert first.output_ids == second.output_ids == expected
    assert second.cached_tokens >= 32


@pytest.mark.parametrize("page", [1, 16])
def test_requests_sent_together_compute_their_shared_prompt_once(roomy_runners, page):
    rng = random.Random(7)
    system = [rng.randrange(2, 512) for _ in range(96)]
    prompts = [system + [rng.randrange(2, 512) for _ in range(5)] for _ in range(4)]
    expected = drive(Engine(roomy_runners[page], prefix_caching=False), prompts, [greedy(4)] * 4)
    engine = Engine(roomy_runners[page])
    assert drive(engine, prompts, [greedy(4)] * 4) == expected
    assert engine.prefill_stats().computed_tokens <= 96 + 4 * 5 + 4 * page  # the others wait a step and share it


def test_a_token_still_on_the_device_is_not_cached():
    kv = KVMemory(
        PageAllocator(32, 1), ReqToTokenPool(2, 64, "cpu"), PagedKVCache(1, 33, 1, 4, torch.float32, "cpu"), 1
    )
    kv.attach_cache(RadixCache(kv))
    scheduler = Scheduler(
        kv, torch.device("cpu"), max_running_requests=2, max_prefill_tokens=64, chunked_prefill_size=64,
        context_length=64,
    )  # fmt: skip
    req = Request(0, [3, 4, 5, 6], greedy(8))
    scheduler.add(req)
    scheduler.schedule()  # the prompt; its first token is sampled on the device and not read yet
    req.num_pending = 1
    scheduler.schedule()  # decode: the pending token is fed on the device at position 4
    assert req.num_cached == 5
    scheduler.finish(req)
    assert kv.prefix_cache.cached_pages == 4  # the four prompt tokens; position 4's token id is unknown


def test_usage_counts_shared_and_cached_pages_once(roomy_runners):
    engine = Engine(roomy_runners[1], overlap_schedule=False)
    prompt = list(range(2, 42))
    drive(engine, [prompt], [greedy(1)])
    usage = engine.kv_usage()
    assert usage.pages_cached == 40 and usage.pages_free == usage.pages_total - 40 and usage.pages_leaked == 0
    a, b = (engine.add_request(prompt + [t], greedy(8)) for t in (7, 8))
    engine.step()
    usage = engine.kv_usage()
    assert usage.pages_held == {a.request_id: 41, b.request_id: 41}
    assert usage.pages_in_use == 42 and usage.pages_cached == 0 and usage.pages_leaked == 0
    lost = engine.runner.kv.allocator.alloc(1)  # a page nobody holds
    assert engine.kv_usage().pages_leaked == 1
    engine.runner.kv.allocator.free(lost)
    while engine.has_work:
        engine.step()


def test_a_weight_update_and_a_failed_step_flush_the_cache(roomy_runners):
    engine = Engine(roomy_runners[1])
    drive(engine, [list(range(2, 30))], [greedy(2)])
    assert engine.prefix_cache.cached_pages > 0
    engine.recompute_all()
    assert engine.prefix_cache.cached_pages == 0 and engine.kv_usage().pages_free == engine.kv_usage().pages_total
    drive(engine, [list(range(2, 30))], [greedy(2)])
    engine.fail_all()
    assert engine.prefix_cache.cached_pages == 0 and engine.kv_usage().pages_free == engine.kv_usage().pages_total


def test_disable_prefix_caching_reaches_the_engine_from_the_cli_and_the_llm():
    parser = argparse.ArgumentParser()
    add_runner_flags(parser)
    assert llm_kwargs(parser.parse_args(["--disable-prefix-caching"])) == {"disable_prefix_caching": True}
    assert "disable_prefix_caching" not in llm_kwargs(parser.parse_args([]))
    with LLM(device="cpu", dtype="float32", max_total_tokens=1024, disable_prefix_caching=True) as llm:
        assert llm.engine.prefix_cache is None and llm.runner.kv.prefix_cache is None
        outputs = llm.generate([[5, 6, 7, 8]] * 2, greedy(2), use_tqdm=False)
        assert llm.engine.prefill_stats().cached_tokens == 0 and outputs[1].cached_tokens == 0


def test_tp2_with_the_cache_gives_the_tp1_tokens_without_it():
    # A stem computed in one batch, then shared by requests in other rows (whose table entries on rank 1 hold other
    # requests' slots): rank 1 must write every shared prefix's table entries from the step's batch. A tight pool
    # (eviction, preemption) and overlap scheduling too.
    rng = random.Random(11)
    stem = [rng.randrange(2, 512) for _ in range(40)]
    first = [stem + [3, 4, 5], [rng.randrange(2, 512) for _ in range(20)], [rng.randrange(2, 512) for _ in range(20)]]
    then = [stem[: rng.randint(16, 40)] + [rng.randrange(2, 512) for _ in range(rng.randint(1, 8))] for _ in range(4)]
    config = dict(FLAGS, max_total_tokens=CONTEXT, context_length=CONTEXT)

    def both(engine: Engine) -> list[list[int]]:
        return [*drive(engine, first, [greedy(8)] * 3), *drive(engine, then, [greedy(8)] * 4)]

    runner = start_runner(RunnerConfig(**config))
    try:
        expected = both(Engine(runner, prefix_caching=False))
    finally:
        runner.close()
    runner = start_runner(RunnerConfig(**config, tp_size=2))
    try:
        engine = Engine(runner, overlap_schedule=True, chunked_prefill_size=16)
        assert both(engine) == expected
        assert engine.prefill_stats().cached_tokens > 0
    finally:
        runner.close()


def test_bench_with_a_shared_prefix_reports_the_cached_prompt_tokens(monkeypatch):
    from omnirun import bench
    from omnirun.bandwidth import Bandwidth

    monkeypatch.setattr(bench, "measure_bandwidth", lambda platform, device: Bandwidth(2e9, 1e9))
    prompts = bench.random_prompts(3, 4, 512, seed=0, shared_prefix_len=40)
    assert all(p[:40] == prompts[0][:40] and len(p) == 44 for p in prompts)
    with LLM("tiny-llama", load_format="dummy", device="cpu", dtype="float32", max_total_tokens=1024) as llm:
        run = dict(batch_size=4, input_len=8, output_len=2, num_prompts=4, warmup=False, shared_prefix_len=64)
        result = bench.run_bench(llm, **run)
    # one request computes the 64 shared tokens; the others wait a step and share them
    assert result["prefill_tokens_computed"] + result["prefill_tokens_cached"] == 4 * 72
    assert result["prefill_tokens_computed"] <= 64 + 4 * 8 and result["prefix_cache_hit_rate"] > 0.6
    assert "hit rate" in bench.format_result(result)
