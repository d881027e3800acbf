"""POST /v1/chat/completions: messages through the tokenizer's chat template (AutoTokenizer.apply_chat_template)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

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
    ChatFunctionCall,
    ChatFunctionCallDelta,
    ChatLogprobs,
    ChatMessage,
    ChatResponseMessage,
    ChatStreamChoice,
    ChatToolCall,
    ChatToolCallDelta,
    ContentPart,
    TokenLogprob,
    TopLogprob,
    new_id,
    now,
)
from omnirun.server.state import ServerState
from omnirun.server.structured import ForcedCalls, named_call, only_one, output_constraints, required_calls
from omnirun.server.tokenize import encode_checked
from omnirun.server.tool_parsers import TOOL_PARSERS, ParsedDelta, ToolParser
from omnirun.server.tool_parsers.tagged import TaggedCalls, tagged_calls


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


def _template_message(message: ChatMessage, index: int) -> dict[str, Any]:
    """A message as HF chat templates take it: a tool call's arguments as a dict (Qwen's and Llama's templates write
    them with `tojson`; vLLM passes dicts too), and the id of the call a tool message answers."""
    out: dict[str, Any] = {"role": message.role, "content": _content(message.content, index)}
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": call.id,
                "type": call.type,
                "function": {
                    "name": call.function.name,
                    "arguments": _arguments(call.function.arguments, f"messages[{index}].tool_calls[{j}]"),
                },
            }
            for j, call in enumerate(message.tool_calls)
        ]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out


def _arguments(text: str, where: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        message = f"{where}.function.arguments is not a JSON object: send the arguments the call was returned with"
        raise OpenAIError(400, message, param="messages")
    return value


def tool_parser_for(state: ServerState, body: ChatCompletionRequest) -> ToolParser | None:
    """The parser that reads this request's output for tool calls; None: the output is all content, or the calls
    are forced by the grammar (forced_calls)."""
    choice = body.tool_choice or ("auto" if body.tools else "none")
    if choice == "none":
        return None
    if not body.tools:
        raise OpenAIError(400, "tool_choice needs tools: send tools, or leave tool_choice out", param="tool_choice")
    if choice != "auto":
        return None
    if state.tool_parser is None:
        names = ", ".join(TOOL_PARSERS)
        message = (
            f"tool_choice 'auto' (the default with tools) needs a tool call parser: start the server with "
            f"--tool-call-parser ({names}), or send tool_choice 'none'"
        )
        raise OpenAIError(400, message, param="tool_choice")
    return state.tool_parser


def _functions(body: ChatCompletionRequest) -> dict[str, dict[str, Any] | None]:
    """Each tool's parameters schema by name (the first of a name wins)."""
    functions: dict[str, dict[str, Any] | None] = {}
    for tool in body.tools or []:
        functions.setdefault(tool.function.name, tool.function.parameters)
    return functions


def forced_calls(body: ChatCompletionRequest) -> ForcedCalls | None:
    """tool_choice required or a named function, which the grammar enforces (no parser needed); None otherwise."""
    if body.tool_choice in (None, "none", "auto") or not body.tools:
        return None
    functions = _functions(body)
    if body.tool_choice == "required":
        return required_calls(functions, parallel=body.parallel_tool_calls)
    return named_call(functions, body.tool_choice.function.name)


def chat_prompt(state: ServerState, body: ChatCompletionRequest) -> list[int]:
    """The templated prompt's token ids (blocking: run it off the event loop, as _prepare does)."""
    tokenizer = state.engine.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise OpenAIError(400, "this model's tokenizer has no chat template: use /v1/completions", param="messages")
    messages = [_template_message(m, i) for i, m in enumerate(body.messages)]
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools] if body.tools else None
    try:
        text = tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=body.add_generation_prompt
        )
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


def _message(
    choice: Choice, parser: ToolParser | TaggedCalls | None, forced: ForcedCalls | None
) -> tuple[ChatResponseMessage, str | None]:
    """A finished choice's message and finish reason: "tool_calls" when the parser found calls (as vLLM says)."""
    if forced is not None:
        calls = [
            ChatToolCall(id=call.id, function=ChatFunctionCall(name=call.name, arguments=call.arguments))
            for call in forced.calls(choice.text)
        ]
        return ChatResponseMessage(content=None, tool_calls=calls or None), forced.finish_reason(choice.finish_reason)
    if parser is None:
        return ChatResponseMessage(content=choice.text), choice.finish_reason
    content, calls = parser.parse(choice.text)
    if not calls:
        return ChatResponseMessage(content=content), choice.finish_reason
    tool_calls = [
        ChatToolCall(id=parser.new_call_id(), function=ChatFunctionCall(name=call.name, arguments=call.arguments))
        for call in calls
    ]
    return ChatResponseMessage(content=content, tool_calls=tool_calls), "tool_calls"


def _chat_delta(parsed: ParsedDelta, forced: bool) -> ChatDelta:
    """A parsed piece as chat's delta; content null beside calls, and all along when the calls are forced."""
    calls = [
        ChatToolCallDelta(
            index=call.index,
            id=call.id,
            type="function" if call.id is not None else None,
            function=ChatFunctionCallDelta(name=call.name, arguments=call.arguments),
        )
        for call in parsed.tool_calls
    ]
    return ChatDelta(content=parsed.content or (None if calls or forced else ""), tool_calls=calls or None)


async def create_chat_completion(body: ChatCompletionRequest, raw: HTTPRequest, state: ServerState):
    model = state.check_model(body.model)
    if body.top_logprobs and not body.logprobs:
        raise OpenAIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    n_top = body.top_logprobs or 0
    parser, forced = tool_parser_for(state, body), forced_calls(body)
    found = output_constraints(body) + ([forced.constraint] if forced is not None else [])
    # auto calls under the grammar, so that their arguments stream in pieces (tagged.py): where the parser's format
    # has a structural tag and nothing else constrains the output.
    tagged = tagged_calls(parser, _functions(body), body.parallel_tool_calls) if not found else None
    if tagged is not None:
        parser, found = tagged, [("tool_choice 'auto'", tagged.spec)]
    constraint = only_one(found)
    max_tokens = body.max_completion_tokens or body.max_tokens
    params = sampling_params(
        body, max_tokens=max_tokens, logprobs=n_top if body.logprobs else None, structured_output=constraint
    )
    if parser is not None and forced is None and parser.needs_special_tokens:
        params = dataclasses.replace(params, skip_special_tokens=False)  # or the parser would never see its marker
    # The template and the tokenizer take seconds for a prompt of megabytes, and a large schema to compile: in a
    # worker thread, so that the event loop goes on answering /health and streaming meanwhile (the tokenizer's Rust
    # half releases the GIL).
    prompt, requests = await asyncio.to_thread(_prepare, state, body, params)
    group = state.engine.submit(requests)
    name = state.token_namer(body.return_tokens_as_token_ids)
    rid, created = new_id("chatcmpl"), now()

    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage

        async def events() -> AsyncIterator[str]:
            choices = [Choice() for _ in requests]
            reader = forced if forced is not None else parser
            streams = [reader.stream() for _ in requests] if reader is not None else None
            try:
                async with group:
                    for index in range(len(requests)):  # the role first, as OpenAI does (content null before calls)
                        role = ChatDelta(role="assistant", content=None if forced is not None else "")
                        first = ChatStreamChoice(index=index, delta=role)
                        yield sse(ChatCompletionChunk(id=rid, created=created, model=model, choices=[first]))
                    async for index, delta in group:
                        start = len(choices[index].token_ids)
                        choices[index].add(delta)
                        logprobs = _logprobs(name, choices[index], start, n_top) if body.logprobs else None
                        finish_reason, out_delta = delta.finish_reason, ChatDelta(content=delta.text or "")
                        if streams is not None:
                            parsed = streams[index].feed(delta.text or "", last=finish_reason is not None)
                            if not parsed and logprobs is None and finish_reason is None:
                                continue  # the parser holds the text back until it knows what it is
                            out_delta = _chat_delta(parsed, forced is not None)
                            if forced is not None:
                                finish_reason = forced.finish_reason(finish_reason)
                            elif finish_reason is not None and streams[index].calls:
                                finish_reason = "tool_calls"
                        out = ChatStreamChoice(
                            index=index, delta=out_delta, logprobs=logprobs, finish_reason=finish_reason
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
    out = []
    for index, choice in enumerate(choices):
        message, finish_reason = _message(choice, parser, forced)
        logprobs = _logprobs(name, choice, 0, n_top) if body.logprobs else None
        out.append(ChatChoice(index=index, message=message, logprobs=logprobs, finish_reason=finish_reason))
    spent = usage([prompt], sum(len(c.token_ids) for c in choices), requests)
    return ChatCompletionResponse(id=rid, created=created, model=model, choices=out, usage=spent)
