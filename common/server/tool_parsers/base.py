"""What every tool call parser shares: the calls and deltas it yields, and one state machine per format that both the
finished-message parse and the stream run.

A format's Scanner takes the model's text in pieces and hands back, in order, content strings and whole ToolCalls.
`parse(text)` feeds it the whole text at once and a stream feeds it each delta, so the two agree by construction
wherever the scanner's decisions depend on the text alone, never on where the pieces were cut (the tests cut at
random to hold that). A call is handed back only once its JSON is complete and valid: text that looks like a call
but is not valid JSON stays content, in the stream too, which never has to take back a call it began. So a call's
arguments reach the stream in one piece, when the call ends; streaming them token by token would send calls that
could still turn out invalid (vLLM's parsers do, and then the stream and the finished message disagree). Under the
grammar a format with a structural tag streams them in pieces instead (omnirun.server.tool_parsers.tagged).
"""

from __future__ import annotations

import dataclasses
import json
import secrets
from collections.abc import Callable
from typing import ClassVar, Protocol


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text (OpenAI's function.arguments)


@dataclasses.dataclass(frozen=True)
class ToolCallDelta:
    """A piece of `delta.tool_calls[i]` in OpenAI's stream: the id and name come once, with the call's first piece;
    the arguments of one index concatenate."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclasses.dataclass(frozen=True)
class ParsedDelta:
    content: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)


Piece = str | ToolCall  # what a scanner hands back: content, or a whole call


class Scanner(Protocol):
    def feed(self, text: str) -> list[Piece]: ...

    def finish(self) -> list[Piece]:
        """The end of the text: what was held back, decided now."""


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is no JSON value")


def loads_json(text: str) -> object:
    """json.loads, refusing NaN and Infinity (which it takes, and clients' JSON parsers do not): ValueError."""
    return json.loads(text, parse_constant=_no_constant)


def call_from_json(text: str, argument_keys: tuple[str, ...] = ("arguments",)) -> ToolCall | None:
    """The call `{"name": ..., <an argument key>: {...}}` written in `text`, or None when `text` is not one."""
    try:
        value = loads_json(text)
    except ValueError:
        return None
    return call_from_object(value, argument_keys)


def call_from_object(value: object, argument_keys: tuple[str, ...] = ("arguments",)) -> ToolCall | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    keys = [key for key in argument_keys if key in value]
    if len(keys) != 1 or not isinstance(value[keys[0]], dict):  # (Llama writes "parameters" or "arguments", not both)
        return None
    arguments = json.dumps(value[keys[0]], ensure_ascii=False)
    try:
        arguments.encode()  # a lone surrogate ("\ud800" in the JSON) cannot go out as UTF-8
    except UnicodeEncodeError:
        return None
    return ToolCall(value["name"], arguments)


def call_header(name: str, arguments_key: str) -> str:
    """`{"name": "<name>", "<arguments_key>": `, a call's opening as the JSON formats write it."""
    return f'{{"name": {json.dumps(name, ensure_ascii=False)}, "{arguments_key}": '


def split_at_marker(text: str, marker: str) -> tuple[str, str | None, str]:
    """`(before, after, held)`: with `marker` in `text`, the text before and after its first occurrence (held is
    ""); without, `after` is None and `held` is the tail of `text` that may still begin the marker (a piece can end
    mid-marker), `before` the rest."""
    at = text.find(marker)
    if at >= 0:
        return text[:at], text[at + len(marker) :], ""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:size]):
            return text[:-size], None, text[-size:]
    return text, None, ""


class ContentAround:
    """Content as the model wrote it, except whitespace that only separates tool calls: a run of whitespace between
    calls, or between one and either end of the text, is dropped; held until text (then it is content), a call or
    the end decides. Without any call, the content is the text, whitespace included."""

    def __init__(self) -> None:
        self._held = ""  # whitespace since the last call (or the start), nothing else since
        self._run_has_text = False
        self._calls = 0

    def content(self, text: str) -> list[Piece]:
        if not text:
            return []
        if self._run_has_text:
            return [text]
        self._held += text
        if self._held.isspace():
            return []
        out, self._held, self._run_has_text = self._held, "", True
        return [out]

    def call(self, call: ToolCall) -> list[Piece]:
        self._held, self._run_has_text = "", False
        self._calls += 1
        return [call]

    def calls(self, calls: list[ToolCall]) -> list[Piece]:
        return [piece for call in calls for piece in self.call(call)]

    def finish(self) -> list[Piece]:
        held, self._held = self._held, ""
        return [held] if held and not self._calls else []


def openai_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


class ToolParser:
    """One format: `parse` for a finished message, `stream()` for a streamed one. Stateless (one per server); the
    state of a message lives in its Scanner."""

    name: ClassVar[str]
    # Its marker is a special token (Mistral's [TOOL_CALLS]): the request's text must keep special tokens.
    needs_special_tokens: ClassVar[bool] = False
    # For `auto` under the grammar (omnirun.server.tool_parsers.tagged): the text that opens a call, a call's text
    # up to its arguments (`call_begin(name)`, which starts with the trigger) and after them (`call_end`). None: the
    # format's calls are read as the model wrote them, each sent whole once its JSON is complete.
    trigger: ClassVar[str | None] = None
    call_end: ClassVar[str] = ""

    def call_begin(self, name: str) -> str:
        raise NotImplementedError(f"the {self.name} format has no structural tag")

    def scanner(self) -> Scanner:
        raise NotImplementedError

    def new_call_id(self) -> str:
        return openai_call_id()

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a finished message; content is None when calls took all of it."""
        scanner = self.scanner()
        pieces = scanner.feed(text) + scanner.finish()
        calls = [piece for piece in pieces if isinstance(piece, ToolCall)]
        content = "".join(piece for piece in pieces if isinstance(piece, str))
        return (content or None) if calls else content, calls

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self.scanner(), self.new_call_id)


class ToolCallStream:
    """One streamed message: text deltas in, content and tool-call deltas out (`feed(..., last=True)` with the last
    delta, to settle what was held back)."""

    def __init__(self, scanner: Scanner, new_call_id: Callable[[], str]) -> None:
        self._scanner = scanner
        self._new_call_id = new_call_id
        self.calls = 0  # calls sent so far

    def feed(self, text: str, *, last: bool = False) -> ParsedDelta:
        pieces = self._scanner.feed(text) if text else []
        if last:
            pieces += self._scanner.finish()
        content, deltas = [], []
        for piece in pieces:
            if isinstance(piece, ToolCall):
                deltas.append(ToolCallDelta(self.calls, self._new_call_id(), piece.name, piece.arguments))
                self.calls += 1
            else:
                content.append(piece)
        return ParsedDelta("".join(content), tuple(deltas))
