"""POST /v1/responses (OpenAI's Responses API), stateless, as vLLM serves it: one assistant message of text.

`input` (a string, or messages whose content is a string or input_text parts) and `instructions` (a system message
placed first) become chat messages and go through the tokenizer's chat template exactly as /v1/chat/completions
sends them; sampling, aborts on a client that went away, and usage are chat's too (generation.py).

Nothing is kept: `store` is accepted, true or false, and no response can be retrieved later; a request that needs
a kept response (previous_response_id, conversation, background) is refused with a 400 saying so. Tools, a
tool_choice that asks for a tool, and text.format json_schema/json_object are refused with a 400 too, until the
tool-call parsers and the grammar serve this route (a faked answer would look like support).

A stream sends OpenAI's events in order, each with its `event:` line and a sequence_number from 0: response.created,
response.in_progress, response.output_item.added, response.content_part.added, response.output_text.delta (as the
engine produces text), response.output_text.done, response.content_part.done, response.output_item.done, then
response.completed with the whole response (as vLLM does, also when it stopped at max_output_tokens, with status
incomplete). An engine error mid-stream is an `error` event with chat's error body, and ends the stream.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request as HTTPRequest
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from omnirun.engine import Request
from omnirun.errors import OmnirunError
from omnirun.sampling import SamplingParams
from omnirun.server.async_engine import RequestGroup
from omnirun.server.chat import chat_prompt
from omnirun.server.errors import OpenAIError
from omnirun.server.generation import (
    Choice,
    collect,
    make_requests,
    sampling_params,
    sse,
    sse_error,
    until_disconnected,
    usage,
)
from omnirun.server.protocol import ChatCompletionRequest, ChatMessage, now
from omnirun.server.responses_protocol import (
    ContentPartEvent,
    IncompleteDetails,
    InputContentPart,
    InputTokensDetails,
    OutputItemEvent,
    OutputMessage,
    OutputText,
    ResponsesRequest,
    ResponsesResponse,
    ResponseStateEvent,
    ResponseUsage,
    TextDeltaEvent,
    TextDoneEvent,
    new_item_id,
)
from omnirun.server.state import ServerState

_ROLES = ("user", "assistant", "system", "developer")
# output_text: an earlier response's output, sent back as the conversation's history (nothing is kept here).
_TEXT_PARTS = ("input_text", "output_text")
_NOT_BUILT = "is not built into /v1/responses yet"


def _refuse_what_is_not_built(body: ResponsesRequest) -> None:
    if body.previous_response_id is not None:
        raise OpenAIError(
            400,
            "previous_response_id: this server keeps no responses; send the whole conversation in input",
            param="previous_response_id",
        )
    if body.conversation is not None:
        raise OpenAIError(
            400,
            "conversation: this server keeps no conversations; send the whole conversation in input",
            param="conversation",
        )
    if body.background:
        raise OpenAIError(
            400, "background: this server keeps no responses to poll; drop background (or stream)", param="background"
        )
    if body.tools:
        raise OpenAIError(400, f"tools: tool calling {_NOT_BUILT}; drop tools", param="tools")
    if body.tool_choice not in (None, "auto", "none"):  # auto and none without tools: plain text, as served
        raise OpenAIError(400, f"tool_choice: tool calling {_NOT_BUILT}; drop tool_choice", param="tool_choice")
    kind = body.text.format.type if body.text is not None and body.text.format is not None else "text"
    if kind != "text":
        raise OpenAIError(
            400, f"text.format {kind!r}: structured output {_NOT_BUILT}; drop text.format for plain text", param="text"
        )


def _text(content: str | list[InputContentPart] | None, where: str) -> str:
    """A message's text: a string, or its text parts joined."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for j, part in enumerate(content):
        if part.type not in _TEXT_PARTS or part.text is None:
            raise OpenAIError(
                400, f"{where}.content[{j}]: only input_text parts are supported, got {part.type!r}", param="input"
            )
        texts.append(part.text)
    return "".join(texts)


def _as_chat(body: ResponsesRequest) -> ChatCompletionRequest:
    """The request as chat's messages: the instructions as a system message first, then the input's messages."""
    if isinstance(body.input, list) and not body.input:
        raise OpenAIError(400, "input is empty: send a string or at least one message", param="input")
    messages = [] if body.instructions is None else [ChatMessage(role="system", content=body.instructions)]
    if isinstance(body.input, str):
        messages.append(ChatMessage(role="user", content=body.input))
        return ChatCompletionRequest(messages=messages)
    for i, item in enumerate(body.input):
        where = f"input[{i}]"
        if item.type != "message":
            raise OpenAIError(
                400,
                f"{where}: only message items are supported, got {item.type!r} (tool calling {_NOT_BUILT})",
                param="input",
            )
        if item.role not in _ROLES:
            raise OpenAIError(400, f"{where}.role: send one of {', '.join(_ROLES)}, got {item.role!r}", param="input")
        messages.append(ChatMessage(role=item.role, content=_text(item.content, where)))
    return ChatCompletionRequest(messages=messages)


def _prepare(state: ServerState, body: ResponsesRequest, params: SamplingParams) -> tuple[list[int], list[Request]]:
    prompt = chat_prompt(state, _as_chat(body))
    return prompt, make_requests(state.engine, [prompt], params, 1)


def _in_progress(body: ResponsesRequest, model: str, params: SamplingParams) -> ResponsesResponse:
    """The response before its output: what the stream's first events carry, and what the finished one extends."""
    return ResponsesResponse(
        id=new_item_id("resp"),
        created_at=now(),
        status="in_progress",
        model=model,
        instructions=body.instructions,
        metadata=body.metadata,
        max_output_tokens=body.max_output_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        tool_choice=body.tool_choice or "auto",
        parallel_tool_calls=body.parallel_tool_calls,
        user=body.user,
    )


def _finished(
    started: ResponsesResponse, item_id: str, choice: Choice, prompt: list[int], requests: list[Request]
) -> ResponsesResponse:
    incomplete = choice.finish_reason == "length"  # max_output_tokens (or the context) cut it
    status = "incomplete" if incomplete else "completed"
    message = OutputMessage(id=item_id, status=status, content=[OutputText(text=choice.text)])
    spent = usage([prompt], len(choice.token_ids), requests)
    cached = spent.prompt_tokens_details.cached_tokens if spent.prompt_tokens_details else 0
    return started.model_copy(
        update={
            "status": status,
            "completed_at": None if incomplete else now(),
            "incomplete_details": IncompleteDetails() if incomplete else None,
            "output": [message],
            "usage": ResponseUsage(
                input_tokens=spent.prompt_tokens,
                input_tokens_details=InputTokensDetails(cached_tokens=cached),
                output_tokens=spent.completion_tokens,
                total_tokens=spent.total_tokens,
            ),
        }
    )


class _Events:
    """Numbers one stream's events from 0 and frames each as SSE with its `event:` line."""

    def __init__(self) -> None:
        self._next = 0

    def __call__(self, event: type[BaseModel], **fields: Any) -> str:
        body = event(sequence_number=self._next, **fields)
        self._next += 1
        return f"event: {body.type}\n{sse(body)}"


async def _stream(
    started: ResponsesResponse, group: RequestGroup, prompt: list[int], requests: list[Request]
) -> AsyncIterator[str]:
    event, item_id, choice = _Events(), new_item_id("msg"), Choice()
    where = {"item_id": item_id, "output_index": 0, "content_index": 0}
    try:
        async with group:
            yield event(ResponseStateEvent, type="response.created", response=started)
            yield event(ResponseStateEvent, type="response.in_progress", response=started)
            empty = OutputMessage(id=item_id, status="in_progress", content=[])
            yield event(OutputItemEvent, type="response.output_item.added", output_index=0, item=empty)
            yield event(ContentPartEvent, type="response.content_part.added", **where, part=OutputText(text=""))
            async for _, delta in group:
                choice.add(delta)
                if delta.text:  # (a step may add no text: partial UTF-8, held back for a stop string)
                    yield event(TextDeltaEvent, **where, delta=delta.text)
    except OmnirunError as exc:  # the engine failed mid-stream: say so as chat does, end the stream
        yield f"event: error\n{sse_error(exc)}"
        return
    done = _finished(started, item_id, choice, prompt, requests)
    message = done.output[0]
    yield event(TextDoneEvent, **where, text=choice.text)
    yield event(ContentPartEvent, type="response.content_part.done", **where, part=message.content[0])
    yield event(OutputItemEvent, type="response.output_item.done", output_index=0, item=message)
    yield event(ResponseStateEvent, type="response.completed", response=done)


async def create_response(body: ResponsesRequest, raw: HTTPRequest, state: ServerState):
    model = state.check_model(body.model)
    _refuse_what_is_not_built(body)
    params = sampling_params(body, max_tokens=body.max_output_tokens, logprobs=None)
    # The template and the tokenizer off the event loop, as chat does (seconds for a prompt of megabytes).
    prompt, requests = await asyncio.to_thread(_prepare, state, body, params)
    group = state.engine.submit(requests)
    started = _in_progress(body, model, params)
    if body.stream:
        return StreamingResponse(_stream(started, group, prompt, requests), media_type="text/event-stream")
    [choice] = await until_disconnected(raw, collect(group), group)
    return _finished(started, new_item_id("msg"), choice, prompt, requests)
