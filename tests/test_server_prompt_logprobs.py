"""`/v1/completions` with `echo` and `logprobs` (and `max_tokens: 0`), as lm-evaluation-harness's log-likelihood
tasks send them, through the real openai client: the prompt's logprobs are the engine's prompt_logprobs (which
tests/test_prompt_logprobs.py checks against HF transformers), followed by the completion's."""

from __future__ import annotations

import contextlib

import openai
import pytest

from omnirun.engine import LLM
from omnirun.engine.process import EngineProcess
from omnirun.sampling import SamplingParams
from omnirun.server.app import create_app
from omnirun.server.testing import running_server

PROMPT = "The quick brown fox jumps over the lazy dog because"


FLAGS = {"device": "cpu", "dtype": "float32", "max_total_tokens": 8192}


@pytest.fixture(scope="module")
def llm():
    with LLM(**FLAGS) as llm:
        yield llm


@pytest.fixture(scope="module", params=["thread", "process"])
def client(request, llm):
    """The server over the LLM's own engine thread, or over an engine process (the deltas cross a pipe)."""
    engine = contextlib.nullcontext(llm) if request.param == "thread" else EngineProcess(**FLAGS)
    with engine as engine, running_server(create_app(engine, served_model_name="tiny")) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


def _expected(llm, n_top: int, max_new_tokens: int):
    params = SamplingParams(temperature=0, max_new_tokens=max_new_tokens, prompt_logprobs=n_top, logprobs=n_top)
    return llm.generate(PROMPT, params, use_tqdm=False)[0]


def test_echo_with_logprobs_and_no_new_token_returns_the_prompt_s_logprobs(llm, client):
    expected = _expected(llm, 2, 0)
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0, echo=True, logprobs=2, temperature=0)
    choice = out.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length" and out.usage.completion_tokens == 0
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(expected.prompt_token_ids) == len(logprobs.text_offset)
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert logprobs.token_logprobs[1:] == pytest.approx(expected.prompt_logprobs[1:], abs=1e-6)
    name = llm.tokenizer.decode
    for top, step in zip(logprobs.top_logprobs[1:], expected.prompt_top_logprobs[1:], strict=True):
        assert top == pytest.approx({name([t]): v for t, v in step}, abs=1e-6)


def test_echo_with_logprobs_then_new_tokens_lists_the_prompt_s_then_the_completion_s(llm, client):
    expected = _expected(llm, 1, 4)
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, echo=True, logprobs=1, temperature=0)
    logprobs = out.choices[0].logprobs
    prompt_len = len(expected.prompt_token_ids)
    assert len(logprobs.tokens) == prompt_len + 4
    assert logprobs.token_logprobs[1:prompt_len] == pytest.approx(expected.prompt_logprobs[1:], abs=1e-6)
    assert logprobs.token_logprobs[prompt_len:] == pytest.approx(expected.logprobs, abs=1e-6)
    assert out.choices[0].text == PROMPT + llm.tokenizer.decode(expected.token_ids)


def test_a_streamed_echo_carries_the_prompt_s_logprobs_in_its_first_chunk(llm, client):
    expected = _expected(llm, 0, 3)
    chunks = list(
        client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=3, echo=True, logprobs=0, temperature=0, stream=True
        )
    )
    token_logprobs = [v for c in chunks for ch in c.choices if ch.logprobs for v in ch.logprobs.token_logprobs]
    prompt_len = len(expected.prompt_token_ids)
    assert chunks[0].choices[0].logprobs.token_logprobs[0] is None
    assert token_logprobs[1:prompt_len] == pytest.approx(expected.prompt_logprobs[1:], abs=1e-6)
    assert token_logprobs[prompt_len:] == pytest.approx(expected.logprobs, abs=1e-6)
