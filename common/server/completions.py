"""POST /v1/completions: prompts as text, a list of texts, token ids or lists of them; n choices each."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from fastapi import Request as HTTPRequest
from fastapi.responses import StreamingResponse

from omnirun.engine import Request
from omnirun.errors import OmnirunError
from omnirun.sampling import SamplingParams
from omnirun.server.errors import OpenAIError
from omnirun.server.generation import (
    DONE,
    Choice,
    collect,
    make_requests,
    sampling_params,
    sse,
    sse_error,
    until_disconnected,
    usage,
)
from omnirun.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    new_id,
    now,
)
from omnirun.server.state import ServerState
from omnirun.server.tokenize import encode_checked


def _prompts(state: ServerState, prompt: str | list) -> list[list[int]]:
    def encode(text: str) -> list[int]:
        return encode_checked(state.engine.encode, text, state.engine.client.facts.context_length)

    if isinstance(prompt, str):
        return [encode(prompt)]
    if prompt and all(isinstance(p, str) for p in prompt):
        return [encode(p) for p in prompt]
    if prompt and all(isinstance(p, list) for p in prompt):
        return [list(p) for p in prompt]
    return [list(prompt)]  # token ids (an empty list is refused by the engine: no token to continue from)


def _prepare(
    state: ServerState, body: CompletionRequest, params: SamplingParams
) -> tuple[list[list[int]], list[Request], list[str]]:
    """The prompts' token ids, their checked requests (n each), and the echoed prompts' text."""
    prompts = _prompts(state, body.prompt)
    requests = make_requests(state.engine, prompts, params, body.n)
    echoes = [state.engine.tokenizer.decode(p) if body.echo else "" for p in prompts]
    return prompts, requests, echoes


def _logprobs(name: Callable[[int], str], choice: Choice, start: int, offset: int, n_top: int) -> CompletionLogprobs:
    """Logprobs of the tokens from `start` on; text offsets count from `offset` (the echoed prompt's length)."""
    tokens = [name(t) for t in choice.token_ids[start:]]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    if n_top:
        top = [{name(t): v for t, v in step} for step in choice.top_logprobs[start:]]
    else:  # logprobs=0: the chosen token only
        top = [{tok: v} for tok, v in zip(tokens, choice.logprobs[start:], strict=True)]
    return CompletionLogprobs(
        text_offset=offsets, token_logprobs=choice.logprobs[start:], tokens=tokens, top_logprobs=top
    )


async def create_completion(body: CompletionRequest, raw: HTTPRequest, state: ServerState):
    model = state.check_model(body.model)
    if body.echo and body.logprobs is not None:
        raise OpenAIError(
            400, "echo with logprobs needs the prompt's logprobs, which omnirun does not compute", param="echo"
        )
    if body.echo and state.engine.tokenizer is None:
        raise OpenAIError(
            400, "echo needs a tokenizer, and this server has none (start it with --tokenizer)", param="echo"
        )
    params = sampling_params(body, max_tokens=body.max_tokens, logprobs=body.logprobs)
    # A prompt of megabytes takes seconds to tokenize (and its ids to check): in a worker thread, so that the event
    # loop goes on answering /health and streaming meanwhile (the tokenizer's Rust half releases the GIL).
    prompts, requests, echoes = await asyncio.to_thread(_prepare, state, body, params)
    group = state.engine.submit(requests)
    name = state.token_namer(body.return_tokens_as_token_ids)
    rid, created = new_id("cmpl"), now()

    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage

        async def events() -> AsyncIterator[str]:
            choices = [Choice() for _ in requests]
            try:
                async with group:
                    async for index, delta in group:
                        choice = choices[index]
                        start, first = len(choice.token_ids), not choice.token_ids and not choice.text
                        choice.add(delta)
                        echo = echoes[index // body.n] if first else ""
                        logprobs = None
                        if body.logprobs is not None:
                            logprobs = _logprobs(
                                name,
                                choice,
                                start,
                                len(echo),
                                body.logprobs,
                            )
                        out = CompletionChoice(
                            index=index,
                            text=echo + (delta.text or ""),
                            logprobs=logprobs,
                            finish_reason=delta.finish_reason,
                        )
                        yield sse(CompletionResponse(id=rid, created=created, model=model, choices=[out]))
            except OmnirunError as exc:  # the engine failed mid-stream: say so, end the stream
                yield sse_error(exc)
                yield DONE
                return
            if include_usage:
                spent = usage(prompts, sum(len(c.token_ids) for c in choices), requests)
                yield sse(CompletionResponse(id=rid, created=created, model=model, choices=[], usage=spent))
            yield DONE

        return StreamingResponse(events(), media_type="text/event-stream")

    choices = await until_disconnected(raw, collect(group), group)
    out = []
    for index, choice in enumerate(choices):
        echo = echoes[index // body.n]
        logprobs = None if body.logprobs is None else _logprobs(name, choice, 0, len(echo), body.logprobs)
        out.append(
            CompletionChoice(
                index=index, text=echo + choice.text, logprobs=logprobs, finish_reason=choice.finish_reason
            )
        )
    spent = usage(prompts, sum(len(c.token_ids) for c in choices), requests)
    return CompletionResponse(id=rid, created=created, model=model, choices=out, usage=spent)
