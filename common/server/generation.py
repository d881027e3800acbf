"""What completions and chat share: sampling parameters from a request body, the n choices of each prompt,
collecting a group's outputs, SSE framing, and giving up on a request whose client went away.

n > 1 runs n requests of the same prompt (the prefix cache shares the prompt's full pages among them). With a
seed, choice j samples with seed + j, so the choices differ and repeat.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Awaitable, Sequence
from typing import Any

from fastapi import Request as HTTPRequest
from pydantic import BaseModel

from omnirun.engine import Request, StreamDelta
from omnirun.sampling import SamplingParams
from omnirun.server.async_engine import AsyncEngine, RequestGroup
from omnirun.server.errors import ClientGone, OpenAIError
from omnirun.server.protocol import PromptTokensDetails, UsageInfo
from omnirun.structured import GrammarSpec

DONE = "data: [DONE]\n\n"


def sampling_params(
    body: Any,
    *,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
    structured_output: GrammarSpec | None = None,
) -> SamplingParams:
    """The SamplingParams of a completions or chat body (SamplingParamsError, a 400, for bad values);
    structured_output: what the output must match (server/structured.py reads it from the body)."""
    bias = None
    if body.logit_bias:
        try:
            bias = {int(token): value for token, value in body.logit_bias.items()}
        except ValueError:
            raise OpenAIError(400, "logit_bias keys are token ids (strings of ints)", param="logit_bias") from None
    return SamplingParams(
        max_new_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        seed=body.seed,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        stop=body.stop or None,
        stop_token_ids=body.stop_token_ids,
        ignore_eos=body.ignore_eos,
        skip_special_tokens=body.skip_special_tokens,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
        logit_bias=bias,
        min_tokens=body.min_tokens,
        structured_output=structured_output,
    )


def make_requests(engine: AsyncEngine, prompts: Sequence[list[int]], params: SamplingParams, n: int) -> list[Request]:
    """n requests per prompt, prompt-major (choice index = prompt index * n + j), all checked before any runs."""
    requests = []
    for prompt in prompts:
        for j in range(n):
            choice = params if params.seed is None or n == 1 else dataclasses.replace(params, seed=params.seed + j)
            requests.append(engine.make_request(prompt, choice))
    return requests


@dataclasses.dataclass
class Choice:
    """One request's output, accumulated from its deltas."""

    token_ids: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    logprobs: list[float] = dataclasses.field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    prompt_logprobs: list[float | None] | None = None  # with SamplingParams.prompt_logprobs (the first delta's)
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None

    def add(self, delta: StreamDelta) -> None:
        self.token_ids += delta.token_ids
        self.text += delta.text or ""
        self.logprobs += delta.logprobs or []
        self.top_logprobs += delta.top_logprobs or []
        self.finish_reason = delta.finish_reason
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs, self.prompt_top_logprobs = delta.prompt_logprobs, delta.prompt_top_logprobs


async def collect(group: RequestGroup) -> list[Choice]:
    choices = [Choice() for _ in group.requests]
    async for index, delta in group:
        choices[index].add(delta)
    return choices


def usage(prompts: Sequence[Sequence[int]], completion_tokens: int, requests: Sequence[Request]) -> UsageInfo:
    """Token counts; a prompt's cached tokens are those every one of its n choices found in the prefix cache."""
    prompt_tokens = sum(len(p) for p in prompts)
    n = len(requests) // len(prompts)
    cached = sum(min(r.cached_tokens for r in requests[i * n : (i + 1) * n]) for i in range(len(prompts)))
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


def sse(chunk: BaseModel) -> str:
    return f"data: {chunk.model_dump_json()}\n\n"


def sse_error(exc: Exception) -> str:
    """An error after the stream started (the status line is gone): an event with OpenAI's error body."""
    body = {"error": {"message": str(exc), "type": "InternalServerError", "param": None, "code": 500}}
    return f"data: {json.dumps(body)}\n\n"


async def until_disconnected(request: HTTPRequest, work: Awaitable[Any], group: RequestGroup) -> Any:
    """Await `work`; if the client disconnects first, abort the group (its pages are freed at the next step)."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watcher = asyncio.ensure_future(work), asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
        group.abort()  # a no-op for requests that finished
    if task not in done:
        raise ClientGone()
    return task.result()


class TokenText:
    """Each token id's own text (what logprobs show), cached: one decode per distinct token."""

    def __init__(self, tokenizer: Any):
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self._tokenizer.decode([token_id])
        return text
