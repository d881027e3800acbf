"""Llama 3.1 / 3.2 JSON tool calls: the whole message is one or more JSON objects, separated by ";", possibly after
the <|python_tag|> token:

    {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {"zone": "CET"}}

("arguments" is taken for "parameters" too, never both in one call.) A message that does not start that way (after
whitespace) is content. If an object is not a call, it and all that follows it are content; the calls before it
stay calls, as a stream has already sent them.
Sources: Meta's Llama 3.1 prompt format and chat template ('Respond in the format {"name": function name,
"parameters": dictionary of argument name and its value}'), and vLLM's
vllm/entrypoints/openai/tool_parsers/llama_tool_parser.py (the optional <|python_tag|>, several calls joined by "; ",
"parameters" or "arguments"). <|python_tag|> is a special token, which omnirun's detokenizer skips: the text mostly
arrives without it.
"""

from __future__ import annotations

import re

from omnirun.server.tool_parsers.base import ContentAround, Piece, ToolParser, call_from_json
from omnirun.server.tool_parsers.json_scan import JsonValueEnd

TAG = "<|python_tag|>"
_LEAD = re.compile(r"\s*(?:<\|python_tag\|>)?\s*")  # before the first object
_SEPARATOR = re.compile(r"\s*;\s*")  # between two objects
_MAYBE_SEPARATOR = re.compile(r"\s*(?:;\s*)?")  # what may still become one (or trail the last call)
_ARGUMENT_KEYS = ("parameters", "arguments")


class Llama3JsonScanner:
    def __init__(self) -> None:
        self._state = "start"  # start, object, between (after a call), text (all the rest is content)
        self._text = ""  # not decided yet
        self._lead = ""  # the text between the last call (or the start) and the object being read
        self._end = JsonValueEnd()
        self._scanned = 0  # how much of an object's text the JsonValueEnd has seen
        self._out = ContentAround()

    def feed(self, text: str) -> list[Piece]:
        self._text += text
        pieces: list[Piece] = []
        while True:
            if self._state == "text":
                pieces += self._out.content(self._text)
                self._text = ""
                return pieces
            if self._state == "object":
                end = self._end.feed(self._text[self._scanned :])
                if end < 0:
                    self._scanned = len(self._text)
                    return pieces
                end += self._scanned
                value, self._text = self._text[:end], self._text[end:]
                call = call_from_json(value, _ARGUMENT_KEYS)
                if call is None:
                    self._state, self._text = "text", self._lead + value + self._text
                else:
                    pieces += self._out.call(call)
                    self._state = "between"
                continue
            # start or between: where does the next object begin?
            if not self._next_object():
                return pieces

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
            self._end, self._scanned = JsonValueEnd(), 0
        self._state = "object" if found_object else "text"
        return True

    def finish(self) -> list[Piece]:
        rest, self._text = self._text, ""
        if self._state == "object":  # the text ended inside an object: no call
            rest = self._lead + rest
        elif self._state == "between":  # whitespace or a ";" after the last call
            rest = ""
        return self._out.content(rest) + self._out.finish()


class Llama3JsonParser(ToolParser):
    name = "llama3_json"

    def scanner(self) -> Llama3JsonScanner:
        return Llama3JsonScanner()
