"""Hermes-style tool calls, as Qwen2.5 and Qwen3 write them (and NousResearch's Hermes 2 Pro, whose format it is):

    Let me look that up.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
    <tool_call>
    {"name": "get_time", "arguments": {"zone": "CET"}}
    </tool_call>

Text before, between or after the blocks is content. A block whose body is not such a JSON object stays content,
tags included; a block the text ends inside (no closing tag: the model stopped on EOS) is a call if its body is one.
Sources: the format in Qwen2.5's chat template ("return a json object with function name and arguments within
<tool_call></tool_call> XML tags"), and vLLM's vllm/entrypoints/openai/tool_parsers/hermes_tool_parser.py (the same
tags, "arguments" as a JSON object, the content being what precedes the first block).
"""

from __future__ import annotations

from omnirun.server.tool_parsers.base import (
    ContentAround,
    Piece,
    ToolParser,
    call_from_json,
    call_header,
    split_at_marker,
)

START, END = "<tool_call>", "</tool_call>"


class HermesScanner:
    def __init__(self) -> None:
        self._text = ""  # not decided yet: a tail that may begin START, or the body of an open block
        self._in_block = False
        self._searched = 0  # how much of an open block's body holds no END (not searched again)
        self._out = ContentAround()

    def feed(self, text: str) -> list[Piece]:
        self._text += text
        pieces: list[Piece] = []
        while True:
            if not self._in_block:
                before, after, held = split_at_marker(self._text, START)
                pieces += self._out.content(before)
                if after is None:
                    self._text = held
                    return pieces
                self._text, self._in_block, self._searched = after, True, 0
            else:
                at = self._text.find(END, self._searched)
                if at < 0:
                    self._searched = max(len(self._text) - len(END) + 1, 0)
                    return pieces
                body, self._text, self._in_block = self._text[:at], self._text[at + len(END) :], False
                pieces += self._block(body, closed=True)

    def finish(self) -> list[Piece]:
        rest, self._text = self._text, ""
        pieces = self._block(rest, closed=False) if self._in_block else self._out.content(rest)
        return pieces + self._out.finish()

    def _block(self, body: str, *, closed: bool) -> list[Piece]:
        call = call_from_json(body)
        if call is None:
            return self._out.content(START + body + (END if closed else ""))
        return self._out.call(call)


class HermesParser(ToolParser):
    name = "hermes"
    trigger = START
    call_end = "}\n" + END  # the call object's brace, then the tag on its own line, as Qwen's template shows it

    def call_begin(self, name: str) -> str:
        return f"{START}\n{call_header(name, 'arguments')}"

    def scanner(self) -> HermesScanner:
        return HermesScanner()
