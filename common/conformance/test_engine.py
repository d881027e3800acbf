"""The engine on the lane's device: equal to the runner-level reference, under memory pressure, and its stop rules."""

from __future__ import annotations

import random

import pytest

from omnirun.engine import LLM, Engine
from omnirun.errors import ConfigError
from omnirun.sampling import SamplingParams
from omnirun.testing import greedy_generate, make_runner


def _run_all(engine: Engine, requests):
    """Step until done; check every request finishes exactly once."""
    finished_ids = []
    while engine.has_work:
        finished_ids += [r.request_id for r in engine.step() if r.finished]
    assert sorted(finished_ids) == sorted(r.request_id for r in requests)
    return [r.output_ids for r in requests]


def _prompts(n: int, seed: int, max_len: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randint(1, max_len))] for _ in range(n)]


# Overlap scheduling on and off, on every device (on a synchronous one it is forced on, to test its bookkeeping).
overlap = pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])


@overlap
@pytest.mark.parametrize("page_size", [1, 16])
def test_engine_greedy_equals_the_runner_reference(platform, tiny_checkpoints, page_size, overlap):
    runner = make_runner(platform, tiny_checkpoints["qwen2"].plain, page_size=page_size)
    prompts = _prompts(6, seed=0)
    expected = [greedy_generate(runner, [p], 16)[0] for p in prompts]
    engine = Engine(runner, overlap_schedule=overlap)
    requests = [engine.add_request(p, SamplingParams(temperature=0, max_new_tokens=16)) for p in prompts]
    assert _run_all(engine, requests) == expected
    # chunked prefill inside the engine gives the same tokens
    engine = Engine(runner, chunked_prefill_size=7, max_prefill_tokens=20, overlap_schedule=overlap)
    requests = [engine.add_request(p, SamplingParams(temperature=0, max_new_tokens=16)) for p in prompts]
    assert _run_all(engine, requests) == expected


@pytest.mark.slow
@overlap
@pytest.mark.parametrize("page_size", [1, 16])
def test_soak_under_memory_pressure_finishes_everything_once(platform, tiny_checkpoints, page_size, overlap):
    """250 requests with random prompt and output lengths against a pool holding a small fraction of them."""
    rng = random.Random(page_size)
    prompts = _prompts(250, seed=page_size)
    params = [SamplingParams(temperature=0, max_new_tokens=rng.randint(1, 80), ignore_eos=True) for _ in prompts]
    demand = sum(len(p) + sp.max_new_tokens for p, sp in zip(prompts, params, strict=True))
    checkpoint = tiny_checkpoints["llama"].plain

    roomy = Engine(make_runner(platform, checkpoint, page_size=page_size, max_total_tokens=demand + 4096))
    reference = _run_all(roomy, [roomy.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)])
    assert roomy.scheduler.num_preemptions == 0

    tight_runner = make_runner(platform, checkpoint, page_size=page_size, max_total_tokens=512, max_running_requests=48)
    assert tight_runner.kv.total_tokens * 8 < demand
    free_before = tight_runner.kv.free_tokens
    tight = Engine(tight_runner, overlap_schedule=overlap)
    requests = [tight.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    outputs = _run_all(tight, requests)
    assert tight.scheduler.num_preemptions > 0, "the pool should have been too small to avoid preemption"
    assert outputs == reference
    assert [len(o) for o in outputs] == [sp.max_new_tokens for sp in params]
    assert all(r.finish_reason.value == "length" for r in requests)
    assert tight_runner.kv.free_tokens == free_before
    assert tight_runner.kv.req_to_token.free_count == tight_runner.kv.req_to_token.max_requests


@overlap
def test_stop_rules(platform, tiny_checkpoints, overlap):
    runner = make_runner(platform, tiny_checkpoints["mistral"].plain)
    prompt = _prompts(1, seed=5)[0]
    free = greedy_generate(runner, [prompt], 12)[0]
    stop_token = free[4]
    first = free.index(stop_token)
    free_before = runner.kv.free_tokens
    engine = Engine(runner, eos_token_ids=[stop_token], overlap_schedule=overlap)
    eos = engine.add_request(prompt, SamplingParams(temperature=0, max_new_tokens=12))
    ignored = engine.add_request(prompt, SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True))
    by_id = engine.add_request(prompt, SamplingParams(temperature=0, max_new_tokens=12, stop_token_ids=[free[2]]))
    _run_all(engine, [eos, ignored, by_id])
    assert (eos.output_ids, eos.finish_reason.value) == (free[: first + 1], "stop")
    assert (ignored.output_ids, ignored.finish_reason.value) == (free, "length")
    assert by_id.output_ids == free[: free.index(free[2]) + 1] and by_id.finish_reason.value == "stop"
    # (with overlap, a stopped request's step computed ahead is dropped and its KV freed all the same)
    assert runner.kv.free_tokens == free_before
    assert runner.kv.req_to_token.free_count == runner.kv.req_to_token.max_requests


@overlap
def test_requests_prefilled_in_different_steps_decode_together(platform, tiny_checkpoints, overlap):
    """Two prefill steps of 8 prompts each, then every decode step carries all 16 (not two alternating halves)."""
    runner = make_runner(platform, tiny_checkpoints["llama"].plain)
    engine = Engine(runner, max_prefill_tokens=8 * 16, overlap_schedule=overlap)
    prompts = [p[:16] + [1] * (16 - len(p[:16])) for p in _prompts(16, seed=11)]
    params = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    requests = [engine.add_request(p, params) for p in prompts]
    launched = []
    launch = engine._launch
    engine._launch = lambda step: launched.append((step.batch.mode.value, step.batch.batch_size)) or launch(step)
    _run_all(engine, requests)
    assert launched == [("extend", 8), ("extend", 8)] + [("decode", 16)] * 7


def test_overlap_gives_the_same_samples_logprobs_and_length_stops(platform, tiny_checkpoints):
    """Seeded sampling, logprobs, max_new_tokens of 1 and the context length: as without overlap."""
    runner = make_runner(platform, tiny_checkpoints["qwen3"].plain)
    prompts = _prompts(5, seed=3)
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_new_tokens=20, logprobs=2),
        SamplingParams(temperature=1.0, top_k=5, seed=8, max_new_tokens=1, logprobs=0),
        SamplingParams(temperature=0, max_new_tokens=10),
        SamplingParams(temperature=0.5, min_p=0.1, seed=9, max_new_tokens=None, ignore_eos=True),  # context length
        SamplingParams(temperature=0, max_new_tokens=3, logprobs=1),
    ]
    results = []
    for overlap in (False, True):
        engine = Engine(runner, overlap_schedule=overlap)
        requests = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
        _run_all(engine, requests)
        results.append([(r.output_ids, r.logprobs, r.top_logprobs, r.finish_reason) for r in requests])
    assert results[0] == results[1]
    lengths = [len(r[0]) for r in results[1]]
    assert lengths[:3] == [20, 1, 10] and lengths[4] == 3
    assert lengths[3] == runner.context_length - len(prompts[3])


def test_request_errors(platform, tiny_checkpoints):
    engine = Engine(make_runner(platform, tiny_checkpoints["llama"].plain))
    with pytest.raises(ConfigError, match="context length is 256"):
        engine.add_request([1] * 256, SamplingParams())
    with pytest.raises(ConfigError, match="empty prompt"):
        engine.add_request([], SamplingParams())
    with pytest.raises(ConfigError, match=r"token id 256 is outside .* \[0, 256\)"):
        engine.add_request([1, 256], SamplingParams())
    with pytest.raises(ConfigError, match=r"token id -1 is outside"):
        engine.add_request([-1, 2], SamplingParams())
    with pytest.raises(ConfigError, match="together past the context length 256; use max_new_tokens <= 246"):
        engine.add_request([1] * 10, SamplingParams(max_new_tokens=247))
    assert not engine.has_work, "a refused request must not be queued"
    with pytest.raises(ConfigError, match="stop strings need a tokenizer"):
        engine.add_request([1, 2], SamplingParams(stop=["x"]))


def test_llm_api_with_the_embedded_model(platform):
    # Runs of one prompt are compared token for token: without the prefix cache each computes the prompt the same way
    # (with it, the last prompt token would run alone, and in bf16 a near tie may break the other way).
    llm = LLM(device=platform.name, max_total_tokens=4096, disable_prefix_caching=True)
    greedy = SamplingParams(temperature=0, max_new_tokens=24)
    outputs = llm.generate(["Hello there", "Paged KV caches"], greedy)
    assert [o.finish_reason for o in outputs] == ["length", "length"]
    assert all(len(o.token_ids) == 24 and isinstance(o.text, str) for o in outputs)
    assert outputs[0].text == llm.tokenizer.decode(outputs[0].token_ids, skip_special_tokens=True)

    # streaming yields the same tokens, and its text pieces add up to the final text
    deltas = list(llm.stream("Hello there", greedy))
    assert [t for d in deltas for t in d.token_ids] == outputs[0].token_ids
    assert "".join(d.text for d in deltas) == outputs[0].text
    assert deltas[-1].finish_reason == "length"

    # a stop string cuts the text before it. The random model's text may be bytes that decode to no character
    # (U+FFFD, which the detokenizer holds back): the stop is taken from the first prompt whose text is characters.
    prompts = ["Paged KV caches", "Hello there", "The model runner", "Once upon a time"]
    texts = [o.text for o in llm.generate(prompts, greedy, use_tqdm=False)]
    prompt, text = next((p, t) for p, t in zip(prompts, texts, strict=True) if len(t) >= 8 and "\ufffd" not in t[:8])
    stop = text[5:8]
    cut = llm.generate(prompt, SamplingParams(temperature=0, max_new_tokens=24, stop=[stop]))[0]
    assert cut.finish_reason == "stop" and cut.text == text[: text.find(stop)]

    # logprobs, token-id prompts, seeded sampling
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_new_tokens=8, logprobs=2)
    ids = llm.encode("Hello there")
    a, b = llm.generate([ids, "Paged KV caches"], sampled), llm.generate(ids, sampled)
    assert a[0].token_ids == b[0].token_ids
    assert len(a[0].logprobs) == 8 and all(len(t) == 2 for t in a[0].top_logprobs)
    with pytest.raises(ConfigError, match="unknown LLM argument"):
        LLM(device=platform.name, max_num_seqs=3)
