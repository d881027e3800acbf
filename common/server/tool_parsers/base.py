"""What every tool call parser shares: the calls and deltas it yields, and one state machine per format that both the
finished-message parse and the stream run.

A format's Scanner takes the model's text in pieces and hands back, in order, content strings and calls: whole
(ToolCall), or begun (CallBegins, once the call's header is read), its arguments in CallArguments pieces as they
arrive, then CallEnds once their JSON value closed. `parse(text)` feeds the stream the whole text at once and a
stream feeds it each delta, so the two agree by construction wherever the scanner's decisions depend on the text
alone, never on where the pieces were cut (the tests cut at random to hold that). What a stream sent cannot be taken
back, so a call that has begun stands whatever follows: its arguments are the model's own text of the value (the
same in the finished message), and text after them that does not close the call as the format does is content; a
message cut inside the arguments ends with them cut (as OpenAI's do). Before a header is complete nothing is
decided, and text that never becomes a call stays content. (vLLM's parsers stream arguments too, re-serialized from
a partial parse, and can disagree with their finished message.)
"""

from __future__ import annotations

import dataclasses
import json
import secrets
from collections.abc import Callable, Iterable
from typing import ClassVar, Protocol

from omnirun.server.tool_parsers.json_scan import JsonValueEnd


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # OpenAI's function.arguments: a JSON object's text, as the model wrote it (hermes re-serializes)


@dataclasses.dataclass(frozen=True)
class ToolCallDelta:
    """A piece of `delta.tool_calls[i]` in OpenAI's stream: the id and name come once, with the call's first piece;
    the arguments of one index concatenate."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclasses.dataclass(frozen=True)
class CallBegins:
    """A call's header is read: its name. Its arguments follow as CallArguments, then CallEnds."""

    name: str


@dataclasses.dataclass(frozen=True)
class CallArguments:
    """The next piece of the arguments of the call begun last, as the model wrote them."""

    text: str


@dataclasses.dataclass(frozen=True)
class CallEnds:
    """The arguments of the call begun last are whole (a call the text ends inside never gets one)."""


@dataclasses.dataclass(frozen=True)
class CallDone:
    """In a stream's pieces: the call of this index ended (the Responses API then closes its item)."""

    index: int


Piece = str | ToolCall | CallBegins | CallArguments | CallEnds  # what a scanner hands back, in the text's order
StreamPiece = str | ToolCallDelta | CallDone  # what a stream hands back: a call's first delta names it


@dataclasses.dataclass(frozen=True)
class ParsedDelta:
    content: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)

    @classmethod
    def of(cls, pieces: Iterable[StreamPiece]) -> ParsedDelta:
        """A stream's pieces of one text delta as one chat delta: the content, and the pieces of a call that follow
        one another as one (a call's header and its first arguments often come in one delta)."""
        content: list[str] = []
        calls: list[ToolCallDelta] = []
        for piece in pieces:
            if isinstance(piece, str):
                content.append(piece)
            elif isinstance(piece, ToolCallDelta):
                if calls and calls[-1].index == piece.index:
                    before = calls.pop()
                    piece = dataclasses.replace(before, arguments=before.arguments + piece.arguments)
                calls.append(piece)
        return cls("".join(content), tuple(calls))


def finished(pieces: Iterable[StreamPiece]) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a finished message, from all of its stream's pieces; content is None when calls took all
    of it."""
    content, calls = "", []
    for piece in pieces:
        if isinstance(piece, str):
            content += piece
        elif isinstance(piece, ToolCallDelta):  # a call's first names it; the others are the last call's arguments
            if piece.name is not None:
                calls.append(ToolCall(piece.name, piece.arguments))
            else:
                calls[-1] = ToolCall(calls[-1].name, calls[-1].arguments + piece.arguments)
    return (content or None) if calls else content, calls


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

    def call(self, piece: Piece) -> list[Piece]:
        """A call (or its beginning) is handed back: the whitespace before it was no content."""
        self._held, self._run_has_text = "", False
        self._calls += 1
        return [piece]

    def finish(self) -> list[Piece]:
        held, self._held = self._held, ""
        return [held] if held and not self._calls else []


class ArgumentsReader:
    """A begun call's arguments, a JSON object or array, as they arrive: all of each piece is sent (none of it can
    be anything but the value) up to where the value closes."""

    def __init__(self) -> None:
        self._end = JsonValueEnd()

    def feed(self, text: str) -> tuple[list[Piece], str | None]:
        """The pieces `text` adds, and the text after the value once it closed (None while it goes on)."""
        at = self._end.feed(text)
        value = text if at < 0 else text[:at]
        pieces: list[Piece] = [CallArguments(value)] if value else []
        if at < 0:
            return pieces, None
        return [*pieces, CallEnds()], text[at:]


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
    # format's calls are read from the text as the model wrote it, unconstrained.
    trigger: ClassVar[str | None] = None
    call_end: ClassVar[str] = ""

    def call_begin(self, name: str) -> str:
        raise NotImplementedError(f"the {self.name} format has no structural tag")

    def scanner(self) -> Scanner:
        raise NotImplementedError

    def new_call_id(self) -> str:
        return openai_call_id()

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a finished message, read as a stream reads it; content is None when calls took all
        of it."""
        return finished(self.stream().pieces(text, last=True))

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self.scanner(), self.new_call_id)


class ToolCallStream:
    """One streamed message: text deltas in, content and tool-call deltas out (`feed(..., last=True)` with the last
    delta, to settle what was held back)."""

    def __init__(self, scanner: Scanner, new_call_id: Callable[[], str]) -> None:
        self._scanner = scanner
        self._new_call_id = new_call_id
        self.calls = 0  # calls begun so far

    def feed(self, text: str, *, last: bool = False) -> ParsedDelta:
        """The next text delta read, as chat streams it: content, and the call pieces."""
        return ParsedDelta.of(self.pieces(text, last=last))

    def pieces(self, text: str, *, last: bool = False) -> list[StreamPiece]:
        """The next text delta read, in the text's order: content strings, call pieces (a call's first has its
        index, id and name), and the end of each call."""
        pieces = self._scanner.feed(text) if text else []
        if last:
            pieces += self._scanner.finish()
        out: list[StreamPiece] = []
        for piece in pieces:
            if isinstance(piece, (ToolCall, CallBegins)):
                arguments = piece.arguments if isinstance(piece, ToolCall) else ""
                out.append(ToolCallDelta(self.calls, self._new_call_id(), piece.name, arguments))
                self.calls += 1
            elif isinstance(piece, CallArguments):
                out.append(ToolCallDelta(self.calls - 1, arguments=piece.text))
            elif isinstance(piece, str):
                out.append(piece)
            if isinstance(piece, (ToolCall, CallEnds)):  # (a whole call ends where it begins)
                out.append(CallDone(self.calls - 1))
        return out
