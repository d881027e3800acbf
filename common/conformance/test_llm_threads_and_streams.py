"""The LLM from several threads, with aborts and streams, on the lane's device: every caller gets exactly its own
outputs, every stream every token, and an aborted or abandoned request gives its pages back."""

from __future__ import annotations

import random
import threading

import pytest

from omnirun.engine import LLM
from omnirun.sampling import SamplingParams


@pytest.fixture(scope="module")
def llm(platform):
    with LLM(device=platform.name, dtype="float32", max_total_tokens=8192, max_running_requests=64) as llm:
        yield llm


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True)


def _assert_all_free(llm: LLM) -> None:
    usage = llm.kv_usage()
    assert usage.pages_held == {} and usage.pages_free + usage.pages_cached == usage.pages_total
    assert usage.pages_leaked == 0
    assert usage.rows_free == usage.rows_total


def test_four_threads_get_exactly_their_own_outputs(llm):
    rng = random.Random(0)
    prompts = [[rng.randrange(512) for _ in range(rng.randint(1, 40))] for _ in range(200)]
    params = [_greedy(rng.randint(1, 24)) for _ in prompts]
    reference = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        mine, r = list(range(k * 50, (k + 1) * 50)), random.Random(k)
        try:
            while mine:
                n = r.randint(1, 8)
                chunk, mine = mine[:n], mine[n:]
                if r.random() < 0.25:  # some as streams, read to the end
                    for i in chunk:
                        results[i] = [t for d in llm.stream(prompts[i], params[i]) for t in d.token_ids]
                else:
                    outs = llm.generate([prompts[i] for i in chunk], [params[i] for i in chunk], use_tqdm=False)
                    results.update({i: o.token_ids for i, o in zip(chunk, outs, strict=True)})
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not errors, errors
    assert [results[i] for i in range(200)] == reference
    _assert_all_free(llm)


def test_interleaved_streams_and_a_stream_open_during_generate_lose_nothing(llm):
    expected = llm.generate(["Hello", "Paged KV"], _greedy(12), use_tqdm=False)
    first, second = llm.stream("Hello", _greedy(12)), llm.stream("Paged KV", _greedy(12))
    deltas = {0: [], 1: []}
    for a, b in zip(first, second, strict=False):  # one delta of each in turn
        deltas[0].append(a)
        deltas[1].append(b)
    deltas[0] += list(first)
    deltas[1] += list(second)
    for k in (0, 1):
        assert [t for d in deltas[k] for t in d.token_ids] == expected[k].token_ids
        assert "".join(d.text for d in deltas[k]) == expected[k].text
        assert deltas[k][-1].finish_reason == "length" and all(d.finish_reason is None for d in deltas[k][:-1])

    # a stream left unread while generate runs to the end: every token is still there afterwards
    stream = llm.stream("Hello", _greedy(12))
    llm.generate(["Paged KV"] * 3, _greedy(20), use_tqdm=False)
    late = list(stream)
    assert [t for d in late for t in d.token_ids] == expected[0].token_ids and late[-1].finish_reason == "length"
    _assert_all_free(llm)


def test_abort_while_waiting_prefilling_and_decoding(platform):
    # One request at a time, a small prefill chunk: the second waits while the first prefills in chunks.
    with LLM(
        device=platform.name, max_total_tokens=4096, max_running_requests=1, chunked_prefill_size=4, dtype="float32"
    ) as llm:
        prompt = [t % 500 + 1 for t in range(800)]  # 200 prefill steps of 4 tokens
        running = llm.stream(prompt, _greedy(200))
        waiting = llm.stream(prompt, _greedy(8))
        llm.abort(waiting.request_id)
        assert [(d.token_ids, d.finish_reason) for d in waiting] == [([], "abort")]
        llm.abort(running.request_id)  # a few of its 200 prefill chunks in
        assert [(d.token_ids, d.finish_reason) for d in running] == [([], "abort")]
        _assert_all_free(llm)

        decoding = llm.stream("Hello", _greedy(400))
        got = [next(decoding) for _ in range(3)]  # three tokens in: it is decoding
        llm.abort(decoding.request_id)
        rest = list(decoding)
        assert rest[-1].finish_reason == "abort" and len(got) + len(rest) < 400
        _assert_all_free(llm)
        llm.abort(decoding.request_id)  # twice, and after its end: harmless

        # the LLM goes on as before
        assert llm.generate("Hello", _greedy(5), use_tqdm=False)[0].finish_reason == "length"


def test_closed_and_abandoned_streams_abort_their_requests(llm):
    closed = llm.stream("Hello", _greedy(500))
    next(closed)
    closed.close()
    abandoned = llm.stream("Hello", _greedy(500))
    next(abandoned)
    del abandoned  # dropped unfinished
    with llm.stream("Hello", _greedy(500)) as in_block:
        next(in_block)
    _assert_all_free(llm)  # (kv_usage runs on the engine thread after the aborts queued before it)
    assert len(llm.generate("Hello", _greedy(8), use_tqdm=False)[0].token_ids) == 8
