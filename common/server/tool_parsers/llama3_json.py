"""Llama 3.1 / 3.2 JSON tool calls: the whole message is one or more JSON objects, separated by ";", possibly after
the <|python_tag|> token:

    {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {"zone": "CET"}}

("arguments" is taken for "parameters" too.) A message that does not start that way (after whitespace) is content.
A call begins once its object's opening, `{"name": "<name>", "parameters": {` (the keys in that order, as Llama
writes them), is read: a stream then sends its name, and its arguments as they come, up to where their JSON value
closes (the model's own text, unchecked). If an object is not a call, it and all that follows it are content; the
calls before it stay calls, as a stream has already sent them. Likewise a call that has begun stays one: if its
object does not close after the arguments (another key follows, say), the text after them is content, and a
message cut inside the arguments ends with them cut.
Sources: Meta's Llama 3.1 prompt format and chat template ('Respond in the format {"name": function name,
"parameters": dictionary of argument name and its value}'), and vLLM's
vllm/entrypoints/openai/tool_parsers/llama_tool_parser.py (the optional <|python_tag|>, several calls joined by "; ",
"parameters" or "arguments"). <|python_tag|> is a special token, which omnirun's detokenizer skips: the text mostly
arrives without it.
"""

from __future__ import annotations

import re

from omnirun.server.tool_parsers.base import ArgumentsReader, CallBegins, ContentAround, Piece, ToolParser
from omnirun.server.tool_parsers.json_scan import read_call_header

TAG = "<|python_tag|>"
_LEAD = re.compile(r"\s*(?:<\|python_tag\|>)?\s*")  # before the first object
_SEPARATOR = re.compile(r"\s*;\s*")  # between two objects
_MAYBE_SEPARATOR = re.compile(r"\s*(?:;\s*)?")  # what may still become one (or trail the last call)
_ARGUMENT_KEYS = ("parameters", "arguments")


class Llama3JsonScanner:
    def __init__(self) -> None:
        # start, header (an object's opening), arguments, close (the object's "}"), between (after a call), text
        # (all the rest is content)
        self._state = "start"
        self._text = ""  # not decided yet
        self._lead = ""  # the text between the last call (or the start) and the object being read
        self._arguments = ArgumentsReader()
        self._out = ContentAround()

    def feed(self, text: str) -> list[Piece]:
        self._text += text
        pieces: list[Piece] = []
        while self._step(pieces):
            pass
        return pieces

    def _step(self, pieces: list[Piece]) -> bool:
        """Move on through what the text decides; False once it decides nothing more."""
        if self._state == "text":
            pieces += self._out.content(self._text)
            self._text = ""
            return False
        if self._state == "header":
            name, end = read_call_header(self._text, _ARGUMENT_KEYS)
            if end < 0:  # not a call: it and all that follows are content
                self._state, self._text = "text", self._lead + self._text
            elif end > 0:
                pieces += self._out.call(CallBegins(name))
                self._state, self._text, self._arguments = "arguments", self._text[end - 1 :], ArgumentsReader()
            return end != 0
        if self._state == "arguments":
            more, rest = self._arguments.feed(self._text)
            pieces += more
            if rest is None:
                self._text = ""
                return False
            self._state, self._text = "close", rest
            return True
        if self._state == "close":
            rest = self._text.lstrip(" \t\n\r")  # JSON's whitespace
            if not rest:
                return False
            if rest[0] == "}":
                self._state, self._text = "between", rest[1:]
            else:  # the call stands (it was sent); what follows its arguments is content
                self._state = "text"
            return True
        # start or between: where does the next object begin?
        return self._next_object()

    def _next_object(self) -> bool:
        """Move on to an object, or to text; False when the text so far cannot tell yet."""
        if self._state == "start":
            lead = _LEAD.match(self._text).group()
            rest = self._text[len(lead) :]
            undecided = not rest or (TAG not in lead and TAG.startswith(rest))
        else:
            found = _SEPARATOR.match(self._text)
            lead = found.group() if found else ""
            rest = self._text[len(lead) :]
            undecided = _MAYBE_SEPARATOR.fullmatch(self._text) is not None
        if undecided:
            return False
        if found_object := (rest[:1] == "{" and (self._state == "start" or lead)):
            self._lead, self._text = lead, rest
        self._state = "header" if found_object else "text"
        return True

    def finish(self) -> list[Piece]:
        rest, self._text = self._text, ""
        if self._state == "header":  # the text ended inside an object's opening: no call
            rest = self._lead + rest
        elif self._state in ("close", "between"):  # whitespace or a ";" after the last call
            rest = ""
        return self._out.content(rest) + self._out.finish()


class Llama3JsonParser(ToolParser):
    name = "llama3_json"

    def scanner(self) -> Llama3JsonScanner:
        return Llama3JsonScanner()
