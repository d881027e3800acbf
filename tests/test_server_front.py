"""The server's front, before a request reaches the engine: a prompt of megabytes is tokenized off the event loop
(/health and open streams go on meanwhile), a body over --max-request-bytes is a 413 before it is parsed, a lone
surrogate or an unknown chat role is a 400, and /metrics counts the requests a client abandoned as "abort"."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable

import httpx
import pytest

from omnirun.engine import LLM
from omnirun.engine.client import ThreadEngine
from omnirun.engine.llm import encode_prompt
from omnirun.server.app import create_app
from omnirun.server.testing import running_server

MODEL = "tiny"
FLAGS = {"device": "cpu", "dtype": "float32", "max_total_tokens": 4096}
LIMIT = 4096  # the small server's --max-request-bytes
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def llm():
    with LLM(**FLAGS) as llm:
        yield llm


@pytest.fixture(scope="module")
def url(llm):
    """A server with the default limit on request bodies (8 MiB)."""
    with running_server(create_app(llm, served_model_name=MODEL)) as url:
        yield url


@pytest.fixture(scope="module")
def small_url(llm):
    with running_server(create_app(llm, served_model_name=MODEL, max_request_bytes=LIMIT)) as url:
        yield url


def _assert_openai_error(response: httpx.Response, status: int, param: str | None = None) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param
    assert error["message"] and "\n" not in error["message"]
    return error["message"]


def _probe_health(url: str, work: Callable[[], None]) -> list[tuple[float, float]]:
    """Run `work` in a thread and GET /health every 20 ms until it is done: (when sent, seconds to answer) each."""
    probes = []
    with httpx.Client(base_url=url) as http:
        http.get("/health")  # (the connection is open before the work starts)
        worker = threading.Thread(target=work)
        worker.start()
        while worker.is_alive():
            start = time.monotonic()
            assert http.get("/health").status_code == 200
            probes.append((start, time.monotonic() - start))
            time.sleep(0.02)
        worker.join()
    return probes


def test_health_answers_within_100ms_while_5mb_prompts_are_refused(url):
    """5 MB of text is about 3 million tokens here, far past the context length of 1,024. Tokenized whole it takes
    about 5 s (the tokenizer's Rust half, without the GIL), and freeing those tokens 0.2-0.4 s holding the GIL; a
    prefix tokenized first refuses it in about 0.15 s. Meanwhile /health answers, and an open stream goes on."""
    body = json.dumps({"prompt": "hello world, the quick brown fox " * (5_000_000 // 33), "max_tokens": 4}).encode()
    refusals: list[tuple[float, httpx.Response]] = []
    window = {}

    def send_big() -> None:
        with httpx.Client(base_url=url, headers=JSON, timeout=60) as http:
            window["start"] = time.monotonic()
            while time.monotonic() < window["start"] + 2.0:
                start = time.monotonic()
                response = http.post("/v1/completions", content=body)
                refusals.append((time.monotonic() - start, response))
            window["end"] = time.monotonic()

    lines: list[float] = []  # when each line of a stream open all along arrived

    def stream() -> None:
        body = {"prompt": "Hello", "max_tokens": 1000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            for _ in response.iter_lines():
                lines.append(time.monotonic())
                if "end" in window:
                    return  # leaving aborts it

    streaming = threading.Thread(target=stream)
    streaming.start()
    deadline = time.monotonic() + 30
    while not lines:
        assert time.monotonic() < deadline, "the stream did not start"
        time.sleep(0.01)
    probes = _probe_health(url, send_big)
    streaming.join(30)

    for seconds, response in refusals:
        message = _assert_openai_error(response, 400)
        assert "tokens" in message and "context length" in message and "1024" in message
        assert seconds < 2.0, f"a 5 MB prompt took {seconds:.1f} s to refuse"
    during = [seconds for start, seconds in probes if window["start"] < start < window["end"]]
    assert len(refusals) >= 3 and len(during) >= 20, (len(refusals), len(during))
    assert max(during) < 0.1, f"/health took up to {max(during) * 1e3:.0f} ms ({len(during)} probes)"
    streamed = [t for t in lines if window["start"] < t < window["end"]]
    assert len(streamed) >= 10, f"the open stream got {len(streamed)} lines in 2 s"


SLOW_S = 1.0


class _SlowTokenizer:
    """The tokenizer, one second slower a call (asleep, as a real one's Rust half is busy without the GIL)."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def __call__(self, *args, **kwargs):
        time.sleep(SLOW_S)
        return self._tokenizer(*args, **kwargs)


class _SlowEngine(ThreadEngine):
    def __init__(self, llm):
        super().__init__(llm)
        self.tokenizer = _SlowTokenizer(llm.tokenizer)

    def encode(self, prompt):
        return encode_prompt(self.tokenizer, prompt)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_tokenizing_runs_off_the_event_loop(llm, path):
    body = {"prompt": "Hello", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}
    answer = {}

    def send() -> None:
        start = time.monotonic()
        answer["response"] = httpx.post(f"{url}{path}", json=body, timeout=30)
        answer["seconds"] = time.monotonic() - start

    with running_server(create_app(_SlowEngine(llm), served_model_name=MODEL)) as url:
        probes = _probe_health(url, send)
    assert answer["response"].status_code == 200 and answer["seconds"] >= SLOW_S  # (it went through the tokenizer)
    slowest = max(seconds for _, seconds in probes)
    assert slowest < 0.1, f"/health took {slowest * 1e3:.0f} ms while a request was being tokenized"
    assert len(probes) >= 10, probes


def test_a_body_over_max_request_bytes_is_a_413_before_it_is_parsed(small_url):
    with httpx.Client(base_url=small_url, headers=JSON) as http:
        # Content-Length over the limit (the body is not JSON at all: it is never parsed)
        message = _assert_openai_error(http.post("/v1/completions", content=b"x" * (LIMIT + 1)), 413)
        assert f"{LIMIT + 1} bytes" in message and "--max-request-bytes" in message

        # chunked (no Content-Length): counted as it arrives
        def chunks():
            for _ in range(2 * LIMIT // 1000):
                yield b"x" * 1000

        response = http.post("/v1/completions", content=chunks())
        assert response.request.headers["transfer-encoding"] == "chunked"
        assert "--max-request-bytes" in _assert_openai_error(response, 413)

        # at the limit exactly (padded with JSON's whitespace), chunked or not: served
        head = b'{"prompt": "Hello", "max_tokens": 2'
        body = head + b" " * (LIMIT - len(head) - 1) + b"}"
        assert len(body) == LIMIT
        assert http.post("/v1/completions", content=body).status_code == 200
        assert http.post("/v1/completions", content=iter([body[:100], body[100:]])).status_code == 200


SURROGATES = [
    ("/v1/completions", b'{"prompt": "\\ud800 hi", "max_tokens": 2}', "prompt"),
    ("/v1/completions", b'{"prompt": ["ok", "hi \\udfff"], "max_tokens": 2}', "prompt"),
    ("/v1/completions", b'{"prompt": "hi", "stop": ["\\ud83d"], "max_tokens": 2}', "stop"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udc00"}], "max_tokens": 2}', "messages"),
    (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "a\\ud800"}]}], "max_tokens": 2}',
        "messages",
    ),
]


@pytest.mark.parametrize("path, body, param", SURROGATES, ids=[str(i) for i in range(len(SURROGATES))])
def test_a_lone_surrogate_is_a_400_in_one_line(url, path, body, param):
    with httpx.Client(base_url=url, headers=JSON) as http:
        message = _assert_openai_error(http.post(path, content=body), 400, param)
        assert "lone UTF-16 surrogate" in message
        # a whole pair is one character (an emoji): served
        pair = b'{"prompt": "\\ud83d\\ude00 hi", "max_tokens": 2}'
        assert http.post("/v1/completions", content=pair).status_code == 200


def test_an_unknown_chat_role_is_a_400_naming_the_roles(url):
    with httpx.Client(base_url=url) as http:
        wizard = {"messages": [{"role": "wizard", "content": "hi"}], "max_tokens": 2}
        message = _assert_openai_error(http.post("/v1/chat/completions", json=wizard), 400, "messages")
        assert "wizard" in message
        for role in ("system", "user", "assistant", "tool", "developer", "function"):
            assert f"'{role}'" in message
        # OpenAI's roles pass (the chat template decides what it makes of them)
        known = [{"role": r, "content": "hi"} for r in ("developer", "system", "user", "assistant", "tool", "user")]
        assert http.post("/v1/chat/completions", json={"messages": known, "max_tokens": 2}).status_code == 200


def _finished(url: str, reason: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(f'omnirun_requests_finished_total{{finish_reason="{reason}"}} '):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {reason!r} finish reason in /metrics")


def test_metrics_count_the_requests_a_client_abandoned_as_abort(llm):
    body = {"prompt": "Hello", "max_tokens": 1000, "ignore_eos": True}
    with running_server(create_app(llm, served_model_name=MODEL)) as url:  # (its own metrics)
        assert _finished(url, "abort") == _finished(url, "length") == 0
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True, "n": 2}) as response:
            assert next(response.iter_lines()).startswith("data: {")
        with pytest.raises(httpx.ReadTimeout):  # not streamed: the client gives up waiting
            httpx.post(f"{url}/v1/completions", json=body, timeout=0.3)
        deadline = time.monotonic() + 5
        while _finished(url, "abort") < 3:
            assert time.monotonic() < deadline, f"abort counted {_finished(url, 'abort')} times, not 3"
            time.sleep(0.02)
        assert httpx.post(f"{url}/v1/completions", json={**body, "max_tokens": 2}).status_code == 200
        assert (_finished(url, "abort"), _finished(url, "length")) == (3, 1)
