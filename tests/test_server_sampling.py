"""The sampling options OpenAI clients send, through `omnirun serve`: every token the server returns is the one a
plain torch reference picks from the model's logits (teacher-forced), and n > 1 gives n choices; with the engine
in a thread of this process and in a process of its own (where the sampler then runs)."""

from __future__ import annotations

import contextlib

import openai
import pytest
import torch

from omnirun.batch import build_batch
from omnirun.engine import LLM
from omnirun.engine.process import EngineProcess
from omnirun.sampling import SamplingParams
from omnirun.server.app import create_app
from omnirun.server.testing import running_server

MODEL = "tiny"
PROMPT = "The model runner"


FLAGS = {"device": "cpu", "dtype": "float32", "max_total_tokens": 8192}


@pytest.fixture(scope="module")
def llm():
    with LLM(**FLAGS) as llm:
        yield llm


@pytest.fixture(scope="module", params=["thread", "process"])
def client(request, llm):
    """A server over the reference LLM's own engine thread, or over an engine process of the same model."""
    with contextlib.ExitStack() as stack:
        engine = llm if request.param == "thread" else stack.enter_context(EngineProcess(**FLAGS))
        url = stack.enter_context(running_server(create_app(engine, served_model_name=MODEL)))
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def _logits_before_each(llm, prompt: list[int], output: list[int]) -> torch.Tensor:
    """The model's logits before each output token, from one prefill on the engine thread (between two steps)."""

    def forward(engine):
        runner = engine.runner
        row = runner.kv.new_request()
        try:
            batch = build_batch(runner.kv, [row], [0], [prompt + output[:-1]], runner.device, return_full_logits=True)
            return runner.forward(batch)[len(prompt) - 1 :].float().cpu()
        finally:
            runner.kv.release(row)

    return llm._loop.call(forward)


def _reference_token(x: torch.Tensor, prompt: list[int], output: list[int], body: dict, eos: set[int]) -> int:
    x = x.clone()
    rep = body.get("repetition_penalty", 1.0)
    for t in set(prompt) | set(output):
        x[t] = x[t] / rep if x[t] > 0 else x[t] * rep
    for t in set(output):
        x[t] -= body.get("frequency_penalty", 0.0) * output.count(t) + body.get("presence_penalty", 0.0)
    for t, b in body.get("logit_bias", {}).items():
        x[int(t)] += b
    if len(output) < body.get("min_tokens", 0):
        x[list(eos | set(body.get("stop_token_ids", [])))] = float("-inf")
    return int(x.argmax())


# The model repeats itself greedily from this prompt ([340] * 10), which the penalties act on.
CASES = {
    "frequency_penalty": {"frequency_penalty": 0.3},
    "presence_penalty": {"presence_penalty": 0.5},
    "repetition_penalty": {"repetition_penalty": 2.0},
    "logit_bias": {"logit_bias": {"9": 1.5, "340": -100}},
    "min_tokens": {"logit_bias": {"1": 30.0}, "min_tokens": 4, "stop_token_ids": [9]},
}


@pytest.mark.parametrize("name", list(CASES))
def test_tokens_are_the_references_on_the_logits(llm, client, name):
    body = CASES[name]
    prompt = llm.encode(PROMPT)
    eos = set(llm.engine.eos_token_ids)
    # (as JSON fields: the typed arguments of the client send the same)
    options = {**body, "return_tokens_as_token_ids": True}
    out = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=10, temperature=0, logprobs=0, extra_body=options
    )
    tokens = [int(t.removeprefix("token_id:")) for t in out.choices[0].logprobs.tokens]
    logits = _logits_before_each(llm, prompt, tokens)
    for t, token in enumerate(tokens):
        assert token == _reference_token(logits[t], prompt, tokens[:t], body, eos), f"{name}: token {t}"
    plain = llm.generate(prompt, SamplingParams(temperature=0, max_new_tokens=10), use_tqdm=False)[0].token_ids
    if name == "min_tokens":  # EOS, pushed up by the bias, comes right after the 4 tokens min_tokens holds it back
        assert len(tokens) == 5 and tokens[-1] in eos and out.choices[0].finish_reason == "stop"
    else:
        assert tokens != plain


def test_n_choices(llm, client):
    prompt = llm.encode(PROMPT)
    greedy = llm.generate(prompt, SamplingParams(temperature=0, max_new_tokens=6), use_tqdm=False)[0].text
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, n=3)
    assert [c.index for c in out.choices] == [0, 1, 2] and {c.text for c in out.choices} == {greedy}
    assert out.usage.completion_tokens == 18 and out.usage.prompt_tokens == len(prompt)

    # Sampled with a seed: choice j is the request seeded with seed + j (so the choices differ, and repeat).
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=1.0, n=3, seed=11)
    for j, choice in enumerate(out.choices):
        alone = llm.generate(prompt, SamplingParams(max_new_tokens=6, seed=11 + j), use_tqdm=False)[0].text
        assert choice.text == alone
    assert len({c.text for c in out.choices}) == 3

    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, n=2, seed=3, stream=True
    )
    texts = ["", ""]
    for chunk in chat:
        texts[chunk.choices[0].index] += chunk.choices[0].delta.content or ""
    assert all(texts) and texts[0] != texts[1]
