"""POST /v1/responses (OpenAI's Responses API), stateless, as vLLM serves it: one assistant message of text, the
function calls that a tool_choice `required` or naming a function forces, or (tool_choice `auto`) the calls that the
server's --tool-call-parser reads out of the text, with the rest of the text as a message.

`input` (a string, or messages whose content is a string or input_text parts, and earlier function_call items with
the function_call_output items that answer them) and `instructions` (a system message placed first) become chat
messages and go through the tokenizer's chat template exactly as /v1/chat/completions sends them, function `tools`
with them; sampling, aborts on a client that went away, and usage are chat's too (generation.py).

`text.format` json_schema or json_object constrains the message's text (server/structured.py); tool_choice `required`
or `{"type": "function", "name": ...}` constrains the output to the calls, as in chat, returned as function_call
items. Tools with tool_choice `auto` (the default with tools) go to the template as chat sends them and the text is
read by the server's tool call parser (chat's tool_parser_for, a 400 naming --tool-call-parser without one): its
calls become function_call items, the rest of the text one message, where it begins (before the calls, as models
write it). tool_choice `none` leaves the text whole.

Nothing is kept: `store` is accepted, true or false, and no response can be retrieved later; a request that needs
a kept response (previous_response_id, conversation, background) is refused with a 400 saying so.

A stream sends OpenAI's events in order, each with its `event:` line and a sequence_number from 0: response.created,
response.in_progress, response.output_item.added, response.content_part.added, response.output_text.delta (as the
engine produces text), response.output_text.done, response.content_part.done, response.output_item.done, then
response.completed with the whole response (as vLLM does, also when it stopped at max_output_tokens, with status
incomplete). Forced calls stream each as response.output_item.added (the function_call, arguments empty),
response.function_call_arguments.delta (as the engine produces them), response.function_call_arguments.done and
response.output_item.done. Parsed calls stream the same way, beside the message's events for the text, each as its
arguments come (under the grammar where the parser's format has a structural tag, as chat; hermes without it sends
each call whole, its arguments in one delta). An engine error mid-stream is an `error` event with chat's
error body, and ends the stream.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import Request as HTTPRequest
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from omnirun.engine import Request
from omnirun.errors import OmnirunError
from omnirun.sampling import SamplingParams
from omnirun.server.async_engine import RequestGroup
from omnirun.server.chat import chat_prompt, tool_parser_for
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
from omnirun.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    FunctionCallParam,
    FunctionParam,
    ToolCallParam,
    ToolParam,
    now,
)
from omnirun.server.responses_protocol import (
    ArgumentsDeltaEvent,
    ArgumentsDoneEvent,
    ContentPartEvent,
    FunctionCallItem,
    IncompleteDetails,
    InputContentPart,
    InputTokensDetails,
    OutputItem,
    OutputItemEvent,
    OutputMessage,
    OutputText,
    ResponsesRequest,
    ResponsesResponse,
    ResponseStateEvent,
    ResponseUsage,
    Status,
    TextDeltaEvent,
    TextDoneEvent,
    new_item_id,
)
from omnirun.server.state import ServerState
from omnirun.server.structured import Constraint, ForcedCalls, json_schema, named_call, only_one, required_calls
from omnirun.server.tool_parsers import ToolCallDelta, ToolParser
from omnirun.server.tool_parsers.base import CallDone
from omnirun.server.tool_parsers.tagged import TaggedCalls, tagged_calls
from omnirun.structured import GrammarSpec

_ROLES = ("user", "assistant", "system", "developer")
# output_text: an earlier response's output, sent back as the conversation's history (nothing is kept here).
_TEXT_PARTS = ("input_text", "output_text")


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


def _functions(body: ResponsesRequest) -> dict[str, FunctionParam]:
    """The function tools by name (the first of a name); a 400 for tools of other kinds."""
    functions: dict[str, FunctionParam] = {}
    for i, tool in enumerate(body.tools or []):
        if tool.type != "function" or not tool.name:
            what = "a function without a name" if tool.type == "function" else f"type {tool.type!r}"
            message = f"tools[{i}]: only function tools with a name are served, got {what}"
            raise OpenAIError(400, message, param="tools")
        function = FunctionParam(name=tool.name, description=tool.description, parameters=tool.parameters)
        functions.setdefault(tool.name, function)
    return functions


def _forced_calls(body: ResponsesRequest, functions: dict[str, FunctionParam]) -> ForcedCalls | None:
    """tool_choice required or naming a function (enforced by the grammar); None for plain text."""
    choice = body.tool_choice if body.tool_choice is not None else ("auto" if functions else "none")
    if choice in ("none", "auto"):  # plain text; or, auto with tools, the text read for calls (_tool_parser)
        return None
    if not functions:
        message = "tool_choice needs tools: send function tools, or leave tool_choice out"
        raise OpenAIError(400, message, param="tool_choice")
    schemas = {name: function.parameters for name, function in functions.items()}
    if choice == "required":
        return required_calls(schemas, parallel=body.parallel_tool_calls)
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return named_call(schemas, choice["name"])
    message = f'tool_choice {choice!r}: send "none", "auto", "required" or {{"type": "function", "name": ...}}'
    raise OpenAIError(400, message, param="tool_choice")


def _tool_parser(state: ServerState, body: ResponsesRequest, functions: dict[str, FunctionParam]) -> ToolParser | None:
    """tool_choice auto with function tools: the server's --tool-call-parser, which reads the calls out of the text,
    as chat's tool_parser_for picks it (a 400 without one); None: the output is all text, or the calls are forced."""
    if not functions or body.tool_choice not in (None, "auto"):
        return None
    as_chat = ChatCompletionRequest.model_construct(tools=_chat_tools(functions), tool_choice="auto")
    try:
        return tool_parser_for(state, as_chat)
    except OpenAIError as exc:  # no parser: chat's words, and the tool choices that need none
        message = f'{exc.message}; \'required\' and {{"type": "function", "name": ...}} (the grammar\'s) need none'
        raise OpenAIError(exc.status, message, param=exc.param) from None


def _text_constraint(body: ResponsesRequest) -> list[Constraint]:
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.type == "text":
        return []
    if fmt.type == "json_object":
        return [("text.format", GrammarSpec.json_object())]
    return [json_schema(fmt.schema_, "text.format")]


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


def _chat_tools(functions: dict[str, FunctionParam]) -> list[ToolParam] | None:
    return [ToolParam(type="function", function=function) for function in functions.values()] or None


def _as_chat(body: ResponsesRequest, functions: dict[str, FunctionParam]) -> ChatCompletionRequest:
    """The request as chat's messages: the instructions as a system message first, then the input's messages; a
    run of function_call items as one assistant message's tool_calls (as chat templates take parallel calls), a
    function_call_output as a tool message answering its call_id."""
    if isinstance(body.input, list) and not body.input:
        raise OpenAIError(400, "input is empty: send a string or at least one message", param="input")
    messages = [] if body.instructions is None else [ChatMessage(role="system", content=body.instructions)]
    tools = _chat_tools(functions)
    if isinstance(body.input, str):
        messages.append(ChatMessage(role="user", content=body.input))
        return ChatCompletionRequest(messages=messages, tools=tools)
    for i, item in enumerate(body.input):
        where = f"input[{i}]"
        if item.type == "function_call":
            if item.call_id is None or item.name is None or item.arguments is None:
                message = f"{where}: a function_call item needs call_id, name and arguments, as it was returned"
                raise OpenAIError(400, message, param="input")
            call = ToolCallParam(id=item.call_id, function=FunctionCallParam(name=item.name, arguments=item.arguments))
            if messages and messages[-1].role == "assistant" and messages[-1].tool_calls:
                messages[-1].tool_calls.append(call)
            else:
                messages.append(ChatMessage(role="assistant", tool_calls=[call]))
        elif item.type == "function_call_output":
            if item.call_id is None or item.output is None:
                message = f"{where}: a function_call_output item needs call_id and output (a string)"
                raise OpenAIError(400, message, param="input")
            messages.append(ChatMessage(role="tool", content=item.output, tool_call_id=item.call_id))
        elif item.type != "message":
            message = (
                f"{where}: only message, function_call and function_call_output items are served, got {item.type!r}"
            )
            raise OpenAIError(400, message, param="input")
        elif item.role not in _ROLES:
            raise OpenAIError(400, f"{where}.role: send one of {', '.join(_ROLES)}, got {item.role!r}", param="input")
        else:
            messages.append(ChatMessage(role=item.role, content=_text(item.content, where)))
    return ChatCompletionRequest(messages=messages, tools=tools)


def _prepare(
    state: ServerState, body: ResponsesRequest, functions: dict[str, FunctionParam], params: SamplingParams
) -> tuple[list[int], list[Request]]:
    prompt = chat_prompt(state, _as_chat(body, functions))
    return prompt, make_requests(state.engine, [prompt], params, 1)


def _in_progress(body: ResponsesRequest, model: str, params: SamplingParams) -> ResponsesResponse:
    """The response before its output: what the stream's first events carry, and what the finished one extends."""
    fmt = body.text.format if body.text is not None else None
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
        tools=[tool.model_dump(exclude_none=True) for tool in body.tools or []],
        tool_choice=body.tool_choice or "auto",
        parallel_tool_calls=body.parallel_tool_calls,
        text={"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt is not None else {"type": "text"}},
        user=body.user,
    )


def _status(choice: Choice) -> Status:
    return "incomplete" if choice.finish_reason == "length" else "completed"  # max_output_tokens (or the context)


def _message(item_id: str, choice: Choice) -> OutputMessage:
    return OutputMessage(id=item_id, status=_status(choice), content=[OutputText(text=choice.text)])


def _finished(
    started: ResponsesResponse, output: list[OutputItem], choice: Choice, prompt: list[int], requests: list[Request]
) -> ResponsesResponse:
    status = _status(choice)
    incomplete = status == "incomplete"
    spent = usage([prompt], len(choice.token_ids), requests)
    cached = spent.prompt_tokens_details.cached_tokens if spent.prompt_tokens_details else 0
    return started.model_copy(
        update={
            "status": status,
            "completed_at": None if incomplete else now(),
            "incomplete_details": IncompleteDetails() if incomplete else None,
            "output": output,
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
    message = _message(item_id, choice)
    done = _finished(started, [message], choice, prompt, requests)
    yield event(TextDoneEvent, **where, text=choice.text)
    yield event(ContentPartEvent, type="response.content_part.done", **where, part=message.content[0])
    yield event(OutputItemEvent, type="response.output_item.done", output_index=0, item=message)
    yield event(ResponseStateEvent, type="response.completed", response=done)


class _CallItems:
    """The function_call items of forced calls, built from their reader's pieces, with the stream events that build
    them: the stream and the finished response go the same way, and agree."""

    def __init__(self, event: _Events) -> None:
        self._event = event
        self.items: list[FunctionCallItem] = []

    def add(self, pieces: Sequence[ToolCallDelta]) -> list[str]:
        events = []
        for piece in pieces:
            if piece.id is not None:  # a new call: the one before it is whole
                events += self.close("completed")
                item = FunctionCallItem(
                    id=new_item_id("fc"), call_id=piece.id, name=piece.name, arguments="", status="in_progress"
                )
                self.items.append(item)
                at = len(self.items) - 1
                events.append(
                    self._event(OutputItemEvent, type="response.output_item.added", output_index=at, item=item)
                )
            if piece.arguments:
                item, at = self.items[-1], len(self.items) - 1
                item.arguments += piece.arguments
                events.append(self._event(ArgumentsDeltaEvent, item_id=item.id, output_index=at, delta=piece.arguments))
        return events

    def close(self, status: Status) -> list[str]:
        """End the last call (status incomplete when the output was cut)."""
        if not self.items or self.items[-1].status != "in_progress":
            return []
        item, at = self.items[-1], len(self.items) - 1
        item.status = status
        return [
            self._event(ArgumentsDoneEvent, item_id=item.id, output_index=at, arguments=item.arguments),
            self._event(OutputItemEvent, type="response.output_item.done", output_index=at, item=item),
        ]


def _call_items(forced: ForcedCalls, choice: Choice) -> list[OutputItem]:
    calls = _CallItems(_Events())
    calls.add(forced.stream().feed(choice.text, last=True).tool_calls)
    calls.close(_status(choice))
    return list(calls.items)


async def _stream_calls(
    started: ResponsesResponse, group: RequestGroup, forced: ForcedCalls, prompt: list[int], requests: list[Request]
) -> AsyncIterator[str]:
    event, choice, reader = _Events(), Choice(), forced.stream()
    calls = _CallItems(event)
    try:
        async with group:
            yield event(ResponseStateEvent, type="response.created", response=started)
            yield event(ResponseStateEvent, type="response.in_progress", response=started)
            async for _, delta in group:
                choice.add(delta)
                for line in calls.add(reader.feed(delta.text or "", last=delta.finish_reason is not None).tool_calls):
                    yield line
    except OmnirunError as exc:  # the engine failed mid-stream: say so as chat does, end the stream
        yield f"event: error\n{sse_error(exc)}"
        return
    for line in calls.close(_status(choice)):
        yield line
    done = _finished(started, list(calls.items), choice, prompt, requests)
    yield event(ResponseStateEvent, type="response.completed", response=done)


class _ParsedItems:
    """The output items of a text read by a tool call parser (tool_choice auto), in the text's order, with the stream
    events that build them, one item done before the next is added (as OpenAI streams them): a message for a run of
    content (the text before the calls, as models write it), and a function_call item per call, added once its
    header is read and its arguments streamed as they come (all at once where the parser reads a call whole: hermes
    without the grammar), done at CallDone; a call cut by max_output_tokens is an incomplete item. The parser's
    stream hands back content and call pieces in order, whatever the pieces the text came in: the stream and the
    finished response agree."""

    def __init__(self, event: _Events, parser: ToolParser | TaggedCalls) -> None:
        self._event = event
        self._stream = parser.stream()
        self.items: list[OutputItem] = []
        self._message: OutputMessage | None = None  # the open one, content arriving
        self._where: dict[str, Any] = {}
        self._call_at = -1  # the output index of the call whose arguments are arriving

    def feed(self, text: str, *, last: bool) -> list[str]:
        events = []
        for piece in self._stream.pieces(text, last=last):
            if isinstance(piece, str):
                events += self._text(piece)
            elif isinstance(piece, CallDone):
                events += self._close_call()
            else:
                if piece.name is not None:  # a call's first piece: its id and name (and maybe arguments)
                    events += self._open_call(piece.id, piece.name)
                events += self._arguments(piece.arguments)
        return events

    def _text(self, text: str) -> list[str]:
        message, events = self._message, []
        if message is None:
            message = self._message = OutputMessage(id=new_item_id("msg"), status="in_progress", content=[])
            self.items.append(message)
            at = len(self.items) - 1
            self._where = {"item_id": message.id, "output_index": at, "content_index": 0}
            events.append(
                self._event(OutputItemEvent, type="response.output_item.added", output_index=at, item=message)
            )
            message.content.append(OutputText(text=""))
            part = OutputText(text="")
            events.append(self._event(ContentPartEvent, type="response.content_part.added", **self._where, part=part))
        message.content[0].text += text
        return [*events, self._event(TextDeltaEvent, **self._where, delta=text)] if text else events

    def _open_call(self, call_id: str, name: str) -> list[str]:
        events = self._close_message("completed")
        item = FunctionCallItem(id=new_item_id("fc"), call_id=call_id, name=name, arguments="", status="in_progress")
        self.items.append(item)
        self._call_at = at = len(self.items) - 1
        events.append(self._event(OutputItemEvent, type="response.output_item.added", output_index=at, item=item))
        return events

    def _arguments(self, piece: str) -> list[str]:
        item, at = self.items[self._call_at], self._call_at
        item.arguments += piece
        return [self._event(ArgumentsDeltaEvent, item_id=item.id, output_index=at, delta=piece)] if piece else []

    def _close_call(self, status: Status = "completed") -> list[str]:
        item, at, self._call_at = self.items[self._call_at], self._call_at, -1
        item.status = status
        return [
            self._event(ArgumentsDoneEvent, item_id=item.id, output_index=at, arguments=item.arguments),
            self._event(OutputItemEvent, type="response.output_item.done", output_index=at, item=item),
        ]

    def _close_message(self, status: Status) -> list[str]:
        message, self._message = self._message, None
        if message is None:
            return []
        message.status, part, at = status, message.content[0], self._where["output_index"]
        return [
            self._event(TextDoneEvent, **self._where, text=part.text),
            self._event(ContentPartEvent, type="response.content_part.done", **self._where, part=part),
            self._event(OutputItemEvent, type="response.output_item.done", output_index=at, item=message),
        ]

    def close(self, status: Status) -> list[str]:
        """End the last message (status incomplete when the output was cut); an empty message when the text held
        nothing, as a plain response has."""
        events = self._text("") if not self.items else []
        if self._call_at >= 0:  # cut inside a call's arguments (max_output_tokens)
            events += self._close_call("incomplete")
        return events + self._close_message(status)


def _parsed_items(parser: ToolParser | TaggedCalls, choice: Choice) -> list[OutputItem]:
    items = _ParsedItems(_Events(), parser)
    items.feed(choice.text, last=True)
    items.close(_status(choice))
    return items.items


async def _stream_parsed(
    started: ResponsesResponse,
    group: RequestGroup,
    parser: ToolParser | TaggedCalls,
    prompt: list[int],
    requests: list[Request],
) -> AsyncIterator[str]:
    event, choice = _Events(), Choice()
    items = _ParsedItems(event, parser)
    try:
        async with group:
            yield event(ResponseStateEvent, type="response.created", response=started)
            yield event(ResponseStateEvent, type="response.in_progress", response=started)
            async for _, delta in group:
                choice.add(delta)
                for line in items.feed(delta.text or "", last=delta.finish_reason is not None):
                    yield line
    except OmnirunError as exc:  # the engine failed mid-stream: say so as chat does, end the stream
        yield f"event: error\n{sse_error(exc)}"
        return
    for line in items.close(_status(choice)):
        yield line
    done = _finished(started, list(items.items), choice, prompt, requests)
    yield event(ResponseStateEvent, type="response.completed", response=done)


async def create_response(body: ResponsesRequest, raw: HTTPRequest, state: ServerState):
    model = state.check_model(body.model)
    _refuse_what_is_not_built(body)
    functions = _functions(body)
    forced = _forced_calls(body, functions)
    parser = _tool_parser(state, body, functions)
    found = _text_constraint(body) + ([forced.constraint] if forced is not None else [])
    # auto calls under the grammar where the parser's format has a structural tag, as chat does (their arguments
    # then stream in pieces)
    schemas = {name: function.parameters for name, function in functions.items()}
    tagged = tagged_calls(parser, schemas, body.parallel_tool_calls) if not found else None
    if tagged is not None:
        parser, found = tagged, [("tool_choice 'auto'", tagged.spec)]
    constraint = only_one(found)
    params = sampling_params(body, max_tokens=body.max_output_tokens, logprobs=None, structured_output=constraint)
    if parser is not None and parser.needs_special_tokens:  # as chat: or the parser would never see its marker
        params = dataclasses.replace(params, skip_special_tokens=False)
    # The template and the tokenizer off the event loop, as chat does (seconds for a prompt of megabytes), and the
    # grammar's compile (seconds for a large schema).
    prompt, requests = await asyncio.to_thread(_prepare, state, body, functions, params)
    group = state.engine.submit(requests)
    started = _in_progress(body, model, params)
    if body.stream:
        if forced is not None:
            events = _stream_calls(started, group, forced, prompt, requests)
        elif parser is not None:
            events = _stream_parsed(started, group, parser, prompt, requests)
        else:
            events = _stream(started, group, prompt, requests)
        return StreamingResponse(events, media_type="text/event-stream")
    [choice] = await until_disconnected(raw, collect(group), group)
    if forced is not None:
        output = _call_items(forced, choice)
    elif parser is not None:
        output = _parsed_items(parser, choice)
    else:
        output = [_message(new_item_id("msg"), choice)]
    return _finished(started, output, choice, prompt, requests)
