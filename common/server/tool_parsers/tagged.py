"""tool_choice `auto` with the grammar's help: free text until the model writes its format's call opener (the
trigger), from there a call the grammar keeps well-formed, `begin(name)` + arguments matching that tool's parameters
schema + `end`, then free text again (xgrammar's triggered structural tag; SGLang constrains `auto` calls the same
way). Because every call that begins is sure to parse, the stream sends a call's id and name as soon as its header
is complete and its arguments in pieces as they come (OpenAI's `delta.tool_calls[i].function.arguments`), where
hermes reading unconstrained text holds each call back until its JSON is whole.

The arguments are the model's own text (valid JSON by the grammar), in the stream and in the finished message
alike, so the two agree; a message cut by max_tokens inside a call ends with that call's arguments cut (as OpenAI's
do), and its finish reason stays "length". Text that does not follow the structure (only possible without the
grammar) stays content.
"""

from __future__ import annotations

from typing import Any

from omnirun.server.tool_parsers.base import (
    CallDone,
    ContentAround,
    ParsedDelta,
    StreamPiece,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    finished,
    openai_call_id,
    split_at_marker,
)
from omnirun.server.tool_parsers.json_scan import JsonValueEnd
from omnirun.structured import GrammarSpec


class TaggedCalls:
    """A parser's calls under the structural tag for `functions` (name -> parameters schema): the grammar spec
    the request runs with, and the reader of its output (`parse` and `stream`, as a ToolParser's)."""

    needs_special_tokens = False

    def __init__(self, parser: ToolParser, functions: dict[str, dict[str, Any]], *, parallel: bool = True) -> None:
        self.trigger = parser.trigger
        self.begins = {parser.call_begin(name): name for name in functions}
        self.end = parser.call_end
        tags = [
            {
                "type": "tag",
                "begin": begin,
                "content": {"type": "json_schema", "json_schema": functions[name]},
                "end": self.end,
            }
            for begin, name in self.begins.items()
        ]
        structure = {
            "type": "triggered_tags",
            "triggers": [self.trigger],
            "tags": tags,
            "at_least_one": False,
            "stop_after_first": not parallel,
        }
        self.spec = GrammarSpec.structural_tag({"type": "structural_tag", "format": structure})

    def new_call_id(self) -> str:
        return openai_call_id()

    def stream(self) -> TaggedCallStream:
        return TaggedCallStream(self)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a finished message: the stream's pieces put together."""
        return finished(self.stream().pieces(text, last=True))


class TaggedCallStream:
    """One message read as it comes: content until the trigger; then the call header (the trigger and the rest of
    one `begin`); then the arguments, sent as they arrive, up to where their JSON value closes; then the `end`."""

    def __init__(self, calls: TaggedCalls) -> None:
        self._calls = calls
        self._state = "text"  # text, header, arguments, end
        self._text = ""  # not decided yet
        self._arguments = JsonValueEnd()
        self._out = ContentAround()
        self.calls = 0  # calls begun so far

    def feed(self, text: str, *, last: bool = False) -> ParsedDelta:
        """The next text delta read, as chat streams it: content, and the call pieces."""
        return ParsedDelta.of(self.pieces(text, last=last))

    def pieces(self, text: str, *, last: bool = False) -> list[StreamPiece]:
        """The next text delta read, in the text's order: content strings, call pieces (a call's first names it),
        and the end of each call."""
        self._text += text
        out: list[StreamPiece] = []
        while self._step(out):
            pass
        if last:
            if self._state in ("text", "header"):  # a header never completed: what it held was text
                out += self._out.content(self._text)
            elif self._state == "arguments" and self._text:  # cut inside the arguments (max_tokens): no CallDone
                out.append(ToolCallDelta(self.calls - 1, arguments=self._text))
            self._text, self._state = "", "text"
            out += self._out.finish()
        return out

    def _step(self, out: list[StreamPiece]) -> bool:
        """Move on through what the text decides; False once it decides nothing more."""
        calls = self._calls
        if self._state == "text":
            before, after, held = split_at_marker(self._text, calls.trigger)
            out += self._out.content(before)
            if after is None:
                self._text = held
                return False
            self._text, self._state = calls.trigger + after, "header"
            return True
        if self._state == "header":
            for begin, name in calls.begins.items():
                if self._text.startswith(begin):
                    self._out.call(ToolCall(name, ""))  # whitespace before a call is not content
                    out.append(ToolCallDelta(self.calls, calls.new_call_id(), name, ""))
                    self.calls += 1
                    self._text, self._state, self._arguments = self._text[len(begin) :], "arguments", JsonValueEnd()
                    return True
            if any(begin.startswith(self._text) for begin in calls.begins):
                return False  # still one of the headers
            out += self._out.content(calls.trigger)  # not a call after all (text the grammar did not shape)
            self._text, self._state = self._text[len(calls.trigger) :], "text"
            return True
        if self._state == "arguments":
            at = self._arguments.feed(self._text)
            piece = self._text if at < 0 else self._text[:at]
            if piece:
                out.append(ToolCallDelta(self.calls - 1, arguments=piece))
            if at < 0:
                self._text = ""
                return False
            self._text, self._state = self._text[at:], "end"
            return True
        # end: the rest of the call's closing text, then free text again
        if len(self._text) < len(calls.end) and calls.end.startswith(self._text):
            return False
        if self._text.startswith(calls.end):
            self._text = self._text[len(calls.end) :]
            out.append(CallDone(self.calls - 1))
        self._state = "text"
        return True


def tagged_calls(
    parser: ToolParser | None, functions: dict[str, dict[str, Any] | None], parallel: bool
) -> TaggedCalls | None:
    """The constrained reading of `auto` calls for a parser whose format has a structural tag (None otherwise);
    `functions`: each tool's parameters schema by name (None: no parameters)."""
    if parser is None or parser.trigger is None or not functions:
        return None
    schemas = {name: schema or {"type": "object", "properties": {}} for name, schema in functions.items()}
    return TaggedCalls(parser, schemas, parallel=parallel)
