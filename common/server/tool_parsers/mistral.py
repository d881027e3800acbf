"""Mistral tool calls (Mistral 7B Instruct v0.3 and the models of its tokenizer's versions before v11): the
[TOOL_CALLS] token, then a JSON list of calls:

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]

Text before [TOOL_CALLS] (or after the list) is content; a list that is not valid JSON, or holds anything but calls,
stays content with its marker. Call ids are 9 letters and digits, as Mistral's chat templates require of the ids
sent back to them ("Tool call IDs should be alphanumeric strings with length 9!").
Sources: vLLM's vllm/entrypoints/openai/tool_parsers/mistral_tool_parser.py (the pre-v11 format, and the ids, after
mistral_common's validator) and examples/tool_chat_template_mistral.jinja. The v11+ format
([TOOL_CALLS]name{arguments}) is not parsed: it stays content.
[TOOL_CALLS] is a special token in Mistral's HF tokenizers, which the detokenizer skips by default: chat requests
parsed by this parser keep special tokens in their text (SamplingParams.skip_special_tokens False), as vLLM does.
"""

from __future__ import annotations

import secrets
import string

from omnirun.server.tool_parsers.base import (
    ContentAround,
    Piece,
    ToolCall,
    ToolParser,
    call_from_object,
    loads_json,
    split_at_marker,
)
from omnirun.server.tool_parsers.json_scan import JsonValueEnd

MARKER = "[TOOL_CALLS]"
_ID_CHARACTERS = string.ascii_letters + string.digits


class MistralScanner:
    def __init__(self) -> None:
        self._state = "text"  # text, lead (after the marker, before "["), list
        self._text = ""  # not decided yet
        self._lead = ""  # whitespace between the marker and the list
        self._end = JsonValueEnd()
        self._scanned = 0
        self._out = ContentAround()

    def feed(self, text: str) -> list[Piece]:
        self._text += text
        pieces: list[Piece] = []
        while True:
            if self._state == "text":
                before, after, held = split_at_marker(self._text, MARKER)
                pieces += self._out.content(before)
                if after is None:
                    self._text = held
                    return pieces
                self._state, self._text = "lead", after
            elif self._state == "lead":
                rest = self._text.lstrip()
                if not rest:
                    return pieces
                if rest[0] != "[":  # no list after the marker: content, marker and all
                    pieces += self._out.content(MARKER)
                    self._state = "text"
                    continue
                self._lead, self._text = self._text[: len(self._text) - len(rest)], rest
                self._state, self._end, self._scanned = "list", JsonValueEnd(), 0
            else:
                end = self._end.feed(self._text[self._scanned :])
                if end < 0:
                    self._scanned = len(self._text)
                    return pieces
                end += self._scanned
                value, self._text = self._text[:end], self._text[end:]
                calls = _calls(value)
                pieces += self._out.calls(calls) if calls else self._out.content(MARKER + self._lead + value)
                self._state = "text"

    def finish(self) -> list[Piece]:
        rest, self._text = self._text, ""
        if self._state != "text":  # the text ended after the marker, before the list did
            rest = MARKER + self._lead + rest
        self._state = "text"
        return self._out.content(rest) + self._out.finish()


def _calls(text: str) -> list[ToolCall]:
    """The calls of a JSON list of them; none unless the list is valid JSON and every item is a call."""
    try:
        value = loads_json(text)
    except ValueError:
        return []
    if not isinstance(value, list):
        return []
    calls = [call_from_object(item) for item in value]
    return calls if calls and None not in calls else []


class MistralParser(ToolParser):
    name = "mistral"
    needs_special_tokens = True

    def scanner(self) -> MistralScanner:
        return MistralScanner()

    def new_call_id(self) -> str:
        return "".join(secrets.choice(_ID_CHARACTERS) for _ in range(9))
