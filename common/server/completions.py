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
from omnirun.server.structured import only_one, output_constraints
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


def _logprobs(
    name: Callable[[int], str],
    token_ids: list[int],
    chosen: list[float | None],
    top: list[list[tuple[int, float]] | None] | None,
    offset: int,
) -> CompletionLogprobs:
    """OpenAI's legacy logprobs of these tokens (the top n where `top` is given, else each token's own); text
    offsets count from `offset`. A None logprob (a prompt's first token) has no top either."""
    tokens = [name(t) for t in token_ids]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    if top is not None:
        tops = [None if step is None else {name(t): v for t, v in step} for step in top]
    else:  # logprobs=0: the chosen token only
        tops = [None if v is None else {tok: v} for tok, v in zip(tokens, chosen, strict=True)]
    return CompletionLogprobs(text_offset=offsets, token_logprobs=chosen, tokens=tokens, top_logprobs=tops)


def _choice_logprobs(
    name: Callable[[int], str], choice: Choice, start: int, offset: int, n_top: int, prompt: list[int] | None
) -> CompletionLogprobs:
    """The logprobs of the choice's tokens from `start` on, after those of the echoed `prompt` when given."""
    out = _logprobs(
        name, choice.token_ids[start:], choice.logprobs[start:], choice.top_logprobs[start:] if n_top else None, offset
    )
    if prompt is None:
        return out
    echoed = _logprobs(name, prompt, choice.prompt_logprobs, choice.prompt_top_logprobs, 0)
    return CompletionLogprobs(
        text_offset=echoed.text_offset + out.text_offset,
        token_logprobs=echoed.token_logprobs + out.token_logprobs,
        tokens=echoed.tokens + out.tokens,
        top_logprobs=echoed.top_logprobs + out.top_logprobs,
    )


async def create_completion(body: CompletionRequest, raw: HTTPRequest, state: ServerState):
    model = state.check_model(body.model)
    if body.echo and state.engine.tokenizer is None:
        raise OpenAIError(
            400, "echo needs a tokenizer, and this server has none (start it with --tokenizer)", param="echo"
        )
    # echo with logprobs: the prompt's too, as lm-evaluation-harness's log-likelihood tasks read them.
    prompt_logprobs = body.logprobs if body.echo else None
    params = sampling_params(
        body,
        max_tokens=body.max_tokens,
        logprobs=body.logprobs,
        prompt_logprobs=prompt_logprobs,
        structured_output=only_one(output_constraints(body)),
    )
    # A prompt of megabytes takes seconds to tokenize (and its ids to check), a large schema seconds to compile: in a
    # worker thread, so that the event loop goes on answering /health and streaming meanwhile (the tokenizer's Rust
    # half releases the GIL).
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
                            echoed = prompts[index // body.n] if first and body.echo else None
                            logprobs = _choice_logprobs(name, choice, start, len(echo), body.logprobs, echoed)
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
        logprobs = None
        if body.logprobs is not None:
            echoed = prompts[index // body.n] if body.echo else None
            logprobs = _choice_logprobs(name, choice, 0, len(echo), body.logprobs, echoed)
        out.append(
            CompletionChoice(
                index=index, text=echo + choice.text, logprobs=logprobs, finish_reason=choice.finish_reason
            )
        )
    spent = usage(prompts, sum(len(c.token_ids) for c in choices), requests)
    return CompletionResponse(id=rid, created=created, model=model, choices=out, usage=spent)
