"""Engine.abort at every stage of a request, step by step, and a soak of 1,000 requests with random aborts under a
KV pool that holds about a tenth of them."""

from __future__ import annotations

import random

import pytest

from omnirun.engine import Engine, FinishReason
from omnirun.sampling import SamplingParams
from omnirun.testing import make_runner

overlap = pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])


def _assert_pool_whole(engine: Engine) -> None:
    usage = engine.kv_usage()
    assert usage.pages_held == {} and usage.pages_free + usage.pages_cached == usage.pages_total
    assert usage.pages_leaked == 0
    assert usage.rows_free == usage.rows_total and not engine.requests


def _drain(engine: Engine) -> None:
    while engine.has_work:
        engine.step()


@overlap
def test_abort_while_waiting_prefilling_and_decoding(platform, tiny_checkpoints, overlap):
    runner = make_runner(platform, tiny_checkpoints["llama"].plain, max_running_requests=1)
    engine = Engine(runner, chunked_prefill_size=4, overlap_schedule=overlap)
    greedy = SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True)
    prefilling = engine.add_request(list(range(1, 60)), greedy)
    waiting = engine.add_request(list(range(1, 10)), greedy)
    engine.step()
    assert 0 < prefilling.num_cached < 59 and waiting.row is None
    held = engine.kv_usage().pages_held[prefilling.request_id]
    assert held > 0

    assert engine.abort(waiting.request_id) is waiting and waiting.finish_reason is FinishReason.ABORT
    assert engine.abort(prefilling.request_id) is prefilling
    usage = engine.kv_usage()  # freed at once, not at the end (the prefix cache may keep its prompt's full pages)
    assert usage.pages_held == {} and usage.pages_free + usage.pages_cached == usage.pages_total
    assert engine.abort(prefilling.request_id) is None  # a second abort finds nothing
    _drain(engine)
    assert prefilling.output_ids == [] and waiting.output_ids == []
    _assert_pool_whole(engine)

    decoding = engine.add_request(list(range(1, 10)), greedy)
    while len(decoding.output_ids) < 3:
        engine.step()
    tokens_then = list(decoding.output_ids)
    engine.abort(decoding.request_id)
    _drain(engine)  # (with overlap, the step in flight computed one more token: it is dropped)
    assert decoding.output_ids == tokens_then and decoding.finish_reason is FinishReason.ABORT
    _assert_pool_whole(engine)


@pytest.mark.slow
def test_soak_with_random_aborts_under_memory_pressure(platform, tiny_checkpoints):
    """(With overlap scheduling, whose bookkeeping has more to get wrong; the 250-request soak runs both ways.)"""
    rng = random.Random(7)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(1, 16))] for _ in range(1000)]
    params = [
        SamplingParams(temperature=0, max_new_tokens=rng.randint(1, 40), ignore_eos=True)
        if rng.random() < 0.5
        else SamplingParams(
            temperature=rng.choice([0.7, 1.0]),
            top_p=rng.choice([1.0, 0.9]),
            top_k=rng.choice([-1, 20]),
            seed=i,
            max_new_tokens=rng.randint(1, 40),
            ignore_eos=True,
        )
        for i in range(1000)
    ]
    checkpoint = tiny_checkpoints["qwen3"].plain
    demand = sum(len(p) + sp.max_new_tokens for p, sp in zip(prompts, params, strict=True))

    roomy = Engine(make_runner(platform, checkpoint, max_total_tokens=demand + 1024), overlap_schedule=False)
    reference = [roomy.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    _drain(roomy)

    runner = make_runner(platform, checkpoint, max_total_tokens=demand // 10, page_size=4)
    engine = Engine(runner, overlap_schedule=True)
    requests = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    finished, aborted = [], set()
    while engine.has_work:
        finished += [r.request_id for r in engine.step() if r.finished]
        if rng.random() < 0.3 and engine.requests:
            victim = rng.choice(sorted(engine.requests))
            finished.append(engine.abort(victim).request_id)
            aborted.add(victim)
    assert engine.scheduler.num_preemptions > 0, "the pool should have been too small to avoid preemption"
    assert len(aborted) > 50
    assert sorted(finished) == sorted(r.request_id for r in requests), "every request ends exactly once"
    for req, ref in zip(requests, reference, strict=True):
        if req.request_id in aborted:
            assert req.finish_reason is FinishReason.ABORT
            assert req.output_ids == ref.output_ids[: len(req.output_ids)]
        else:
            assert (req.output_ids, req.finish_reason) == (ref.output_ids, ref.finish_reason)
    _assert_pool_whole(engine)
