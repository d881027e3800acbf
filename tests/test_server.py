"""`omnirun serve` against the real OpenAI client: a real uvicorn server on a free port, the embedded model, with
the engine in a thread of this process and in a process of its own (EngineProcess); outputs are compared with an
LLM's in this process."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import openai
import pytest

from omnirun.engine import LLM
from omnirun.engine.process import EngineProcess
from omnirun.sampling import SamplingParams
from omnirun.server.app import create_app
from omnirun.server.testing import running_server

MODEL = "tiny"
KEY = "test-key"


FLAGS = {"device": "cpu", "dtype": "float32", "max_total_tokens": 16384}


@pytest.fixture(scope="module")
def llm():
    with LLM(**FLAGS) as llm:
        yield llm


@pytest.fixture(scope="module", params=["thread", "process"])
def engine(request, llm):
    """What the server runs: the reference LLM's own engine thread, or an engine process of the same model."""
    if request.param == "thread":
        yield llm
    else:
        with EngineProcess(**FLAGS) as engine:
            yield engine


@pytest.fixture(scope="module")
def url(engine):
    with running_server(create_app(engine, served_model_name=MODEL, api_key=KEY)) as url:
        yield url


@pytest.fixture
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)


def _greedy(llm, prompt, n: int, **kw):
    return llm.generate(prompt, SamplingParams(temperature=0, max_new_tokens=n, **kw), use_tqdm=False)[0]


def _pool_whole_within(engine, seconds: float) -> float:
    """Wait until every KV page is free (or only cached) and no request is live; returns how long that took."""
    start = time.monotonic()
    while True:
        usage = engine.kv_usage()
        if usage.pages_free + usage.pages_cached == usage.pages_total and not usage.pages_held:
            return time.monotonic() - start
        if time.monotonic() - start > seconds:
            raise AssertionError(f"KV pages not all back after {seconds} s: {usage}")
        time.sleep(0.02)


def test_completions_greedy_text_equals_llm_generate(llm, client):
    prompt = "Hello, world!"
    expected = _greedy(llm, prompt, 12)
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    assert out.object == "text_completion" and out.id.startswith("cmpl-") and out.created > 0
    assert out.choices[0].text == expected.text and out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(llm.encode(prompt)), 12)
    assert out.usage.total_tokens == out.usage.prompt_tokens + 12

    usage = {"include_usage": True}
    stream = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True, stream_options=usage
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12

    # token ids, several prompts, echo
    ids = [llm.encode("The KV cache"), llm.encode("pages")]
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0, echo=True)
    for choice, prompt_ids in zip(out.choices, ids, strict=True):
        want = _greedy(llm, prompt_ids, 5)
        assert choice.text == llm.tokenizer.decode(prompt_ids) + want.text
    assert out.usage.prompt_tokens == sum(map(len, ids))


def test_a_repeated_prompt_reports_its_cached_tokens(llm, client):
    prompt = list(range(5, 45))  # 40 tokens, as ids: the first request computes them, the second shares 39
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 39 and second.choices[0].text == first.choices[0].text


def test_completions_stop_and_logprobs(llm, client):
    expected = _greedy(llm, "Hello", 6, logprobs=2)
    out = client.completions.create(model=MODEL, prompt="Hello", max_tokens=6, temperature=0, logprobs=2)
    logprobs = out.choices[0].logprobs
    assert logprobs.token_logprobs == pytest.approx(expected.logprobs)
    assert [len(top) for top in logprobs.top_logprobs] == [2] * 6
    assert "".join(logprobs.tokens) == out.choices[0].text
    stop = expected.text[3:6]
    out = client.completions.create(model=MODEL, prompt="Hello", max_tokens=6, temperature=0, stop=[stop])
    assert out.choices[0].finish_reason == "stop" and stop not in out.choices[0].text


def test_a_streamed_stop_string_ends_the_text_before_it_as_llm_generate_does(llm, client):
    # (the engine process decodes requests with stop strings itself, and the others' text in the server)
    whole = _greedy(llm, "The KV cache", 10).text
    stop = whole[len(whole) // 2 : len(whole) // 2 + 3]
    expected = _greedy(llm, "The KV cache", 10, stop=[stop])
    assert expected.finish_reason == "stop" and len(expected.text) < len(whole)
    chunks = list(
        client.completions.create(
            model=MODEL, prompt="The KV cache", max_tokens=10, temperature=0, stop=[stop], stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_chat_greedy_text_equals_llm_generate_on_the_templated_prompt(llm, client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    text = llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt_ids = llm.tokenizer(text, add_special_tokens=False).input_ids
    expected = _greedy(llm, prompt_ids, 10, logprobs=3)

    out = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=10, temperature=0, logprobs=True, top_logprobs=3
    )
    assert out.object == "chat.completion" and out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == expected.text
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(prompt_ids), 10)
    content = out.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx(expected.logprobs)
    got_top = [t.logprob for c in content for t in c.top_logprobs]
    assert got_top == pytest.approx([v for top in expected.top_logprobs for _, v in top])

    usage = {"include_usage": True}
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=10, temperature=0, stream=True, stream_options=usage
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert chunks[-1].usage.completion_tokens == 10


def test_64_concurrent_streams_each_get_their_own_greedy_output(llm, engine, url):
    prompts = [f"Request {i}: the model runner" for i in range(64)]
    expected = llm.generate(prompts, SamplingParams(temperature=0, max_new_tokens=8), use_tqdm=False)

    async def one(client: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True)
        return "".join([c.choices[0].text async for c in stream])

    async def all_of_them() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    texts = asyncio.run(all_of_them())
    assert texts == [e.text for e in expected]
    _pool_whole_within(engine, 1.0)


def test_a_client_that_disconnects_has_its_request_aborted_and_pages_freed(engine, url):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 1000, "ignore_eos": True, "temperature": 0}
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=url, headers=headers) as http:
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            assert engine.kv_usage().pages_held, "the request should hold pages while it streams"
        # leaving the block closed the connection mid-stream
        assert _pool_whole_within(engine, 1.0) < 1.0

        # a plain (not streamed) request whose client gives up waiting
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/completions", json=body, timeout=0.3)
        assert _pool_whole_within(engine, 1.0) < 1.0


ERRORS = [
    # (body or raw bytes, status, param)
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    ({"model": MODEL}, 400, "prompt"),
    ({"model": MODEL, "prompt": "a", "max_tokens": "3"}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "a", "temperature": -1}, 400, "temperature"),
    ({"model": MODEL, "prompt": "a", "top_p": 1.5}, 400, "top_p"),
    ({"model": MODEL, "prompt": "a", "n": 0}, 400, "n"),
    ({"model": MODEL, "prompt": "a", "logprobs": 21}, 400, "logprobs"),
    ({"model": MODEL, "prompt": "a", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ({"model": MODEL, "prompt": "a", "top_k": -5}, 400, None),
    ({"model": MODEL, "prompt": "a", "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ({"model": MODEL, "prompt": "a", "logit_bias": {"100000": 1}}, 400, None),
    ({"model": MODEL, "prompt": []}, 400, None),
    ({"model": MODEL, "prompt": [1, 99999]}, 400, None),
    ({"model": MODEL, "prompt": "a " * 1100}, 400, None),
    ({"model": MODEL, "prompt": "a", "max_tokens": 5000}, 400, None),
    ({"model": "gpt-4", "prompt": "a"}, 404, "model"),
]


@pytest.mark.parametrize("body, status, param", ERRORS, ids=[str(i) for i in range(len(ERRORS))])
def test_bad_requests_get_openai_errors_and_the_server_goes_on(engine, url, body, status, param):
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    with httpx.Client(base_url=url, headers=headers) as http:
        if isinstance(body, bytes):
            response = http.post("/v1/completions", content=body)
        else:
            response = http.post("/v1/completions", json=body)
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["message"] and "\n" not in error["message"] and error["param"] == param
        ok = http.post("/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 2})
        assert ok.status_code == 200
    _pool_whole_within(engine, 1.0)


def test_chat_errors(client):
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model=MODEL, messages=[])
    with pytest.raises(openai.BadRequestError, match="only text parts"):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
        )
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=[{"role": "user", "content": "hi"}])


def test_api_key_is_required_on_v1(url):
    for key in ("wrong", ""):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=key or "unused", max_retries=0)
        if not key:
            client = client.with_options(default_headers={"Authorization": ""})
        with pytest.raises(openai.AuthenticationError) as info:
            client.models.list()
        assert info.value.status_code == 401 and info.value.body["code"] == "invalid_api_key"
    assert httpx.get(f"{url}/health").status_code == 200  # outside /v1: no key needed


def test_more_waiting_requests_than_allowed_get_503_with_retry_after(llm):
    gate = threading.Event()
    holding = threading.Thread(target=llm._loop.call, args=(lambda engine: gate.wait(30),))
    with running_server(create_app(llm, served_model_name=MODEL, max_queued_requests=1)) as url:
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 3, "stream": True}
        holding.start()  # the engine thread waits on the gate: submitted requests wait for a first token
        try:
            with httpx.Client(base_url=url) as http, http.stream("POST", "/v1/completions", json=body) as first:
                assert first.status_code == 200
                refused = http.post("/v1/completions", json=body)
                assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
                assert "--max-queued-requests" in refused.json()["error"]["message"]
                gate.set()
                assert list(first.iter_lines())[-2] == "data: [DONE]"
                assert http.post("/v1/completions", json={**body, "stream": False}).status_code == 200
        finally:
            gate.set()
            holding.join()
    _pool_whole_within(llm, 1.0)


def test_models_health_and_metrics(engine, client, url):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL] and models.data[0].object == "model"
    assert httpx.get(f"{url}/health").status_code == 200
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=4)
    metrics = httpx.get(f"{url}/metrics")
    assert metrics.headers["content-type"].startswith("text/plain")
    values = {}
    for line in metrics.text.splitlines():
        if not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    usage = engine.kv_usage()
    assert values["omnirun_kv_pages_total"] == usage.pages_total
    assert values["omnirun_kv_pages_used"] == 0 and values["omnirun_requests_running"] == 0
    assert values["omnirun_generation_tokens_total"] >= 4 and values["omnirun_prompt_tokens_total"] >= 1
    assert values['omnirun_requests_finished_total{finish_reason="length"}'] >= 1
    for name in ("time_to_first_token", "inter_token_latency", "e2e_request_latency"):
        assert values[f"omnirun_{name}_seconds_count"] >= 1
    assert "omnirun_preemptions_total" in values and "omnirun_requests_waiting" in values
