"""POST /v1/chat/completions: messages through the tokenizer's chat template (AutoTokenizer.apply_chat_template)."""

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
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatResponseMessage,
    ChatStreamChoice,
    ContentPart,
    TokenLogprob,
    TopLogprob,
    new_id,
    now,
)
from omnirun.server.state import ServerState
from omnirun.server.tokenize import encode_checked


def _content(content: str | list[ContentPart] | None, index: int) -> str:
    """A message's text: a string, or the text parts of a list of content parts."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        if part.type != "text" or part.text is None:
            raise OpenAIError(
                400, f"messages[{index}].content: only text parts are supported, got {part.type!r}", param="messages"
            )
        texts.append(part.text)
    return "".join(texts)


def chat_prompt(state: ServerState, body: ChatCompletionRequest) -> list[int]:
    """The templated prompt's token ids (blocking: run it off the event loop, as _prepare does)."""
    tokenizer = state.engine.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise OpenAIError(400, "this model's tokenizer has no chat template: use /v1/completions", param="messages")
    messages = [{"role": m.role, "content": _content(m.content, i)} for i, m in enumerate(body.messages)]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=body.add_generation_prompt)
    except Exception as exc:  # jinja raises for templates that refuse a role order, say
        raise OpenAIError(400, f"the chat template refused the messages: {exc}", param="messages") from None

    def encode(text: str) -> list[int]:  # the template wrote the special tokens
        return list(tokenizer(text, add_special_tokens=False).input_ids)

    return encode_checked(encode, text, state.engine.client.facts.context_length)


def _prepare(
    state: ServerState, body: ChatCompletionRequest, params: SamplingParams
) -> tuple[list[int], list[Request]]:
    prompt = chat_prompt(state, body)
    return prompt, make_requests(state.engine, [prompt], params, body.n)


def _logprobs(name: Callable[[int], str], choice: Choice, start: int, n_top: int) -> ChatLogprobs:
    def top(token_id: int, logprob: float) -> TopLogprob:
        text = name(token_id)
        return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))

    content = []
    for i, (token_id, logprob) in enumerate(zip(choice.token_ids[start:], choice.logprobs[start:], strict=True)):
        entry = top(token_id, logprob)
        alternatives = [top(t, v) for t, v in choice.top_logprobs[start + i]] if n_top else []
        content.append(TokenLogprob(**entry.model_dump(), top_logprobs=alternatives))
    return ChatLogprobs(content=content)


async def create_chat_completion(body: ChatCompletionRequest, raw: HTTPRequest, state: ServerState):
    model = state.check_model(body.model)
    if body.top_logprobs and not body.logprobs:
        raise OpenAIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    n_top = body.top_logprobs or 0
    max_tokens = body.max_completion_tokens or body.max_tokens
    params = sampling_params(body, max_tokens=max_tokens, logprobs=n_top if body.logprobs else None)
    # The template and the tokenizer take seconds for a prompt of megabytes: in a worker thread, so that the event
    # loop goes on answering /health and streaming meanwhile (the tokenizer's Rust half releases the GIL).
    prompt, requests = await asyncio.to_thread(_prepare, state, body, params)
    group = state.engine.submit(requests)
    name = state.token_namer(body.return_tokens_as_token_ids)
    rid, created = new_id("chatcmpl"), now()

    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage

        async def events() -> AsyncIterator[str]:
            choices = [Choice() for _ in requests]
            try:
                async with group:
                    for index in range(len(requests)):  # the role first, as OpenAI does
                        first = ChatStreamChoice(index=index, delta=ChatDelta(role="assistant", content=""))
                        yield sse(ChatCompletionChunk(id=rid, created=created, model=model, choices=[first]))
                    async for index, delta in group:
                        start = len(choices[index].token_ids)
                        choices[index].add(delta)
                        logprobs = _logprobs(name, choices[index], start, n_top) if body.logprobs else None
                        out = ChatStreamChoice(
                            index=index,
                            delta=ChatDelta(content=delta.text or ""),
                            logprobs=logprobs,
                            finish_reason=delta.finish_reason,
                        )
                        yield sse(ChatCompletionChunk(id=rid, created=created, model=model, choices=[out]))
            except OmnirunError as exc:  # the engine failed mid-stream: say so, end the stream
                yield sse_error(exc)
                yield DONE
                return
            if include_usage:
                spent = usage([prompt], sum(len(c.token_ids) for c in choices), requests)
                yield sse(ChatCompletionChunk(id=rid, created=created, model=model, choices=[], usage=spent))
            yield DONE

        return StreamingResponse(events(), media_type="text/event-stream")

    choices = await until_disconnected(raw, collect(group), group)
    out = [
        ChatChoice(
            index=index,
            message=ChatResponseMessage(content=choice.text),
            logprobs=_logprobs(name, choice, 0, n_top) if body.logprobs else None,
            finish_reason=choice.finish_reason,
        )
        for index, choice in enumerate(choices)
    ]
    spent = usage([prompt], sum(len(c.token_ids) for c in choices), requests)
    return ChatCompletionResponse(id=rid, created=created, model=model, choices=out, usage=spent)
