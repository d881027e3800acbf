"""Mistral tool calls, in both of the formats Mistral's tokenizers write. Before v11 (Mistral 7B Instruct v0.3), the
[TOOL_CALLS] token, then a JSON list of calls:

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]

From v11 (Mistral Small 3.1 and later), each call is [TOOL_CALLS], its name, the [CALL_ID] token and an id (v11
only), the [ARGS] token, and its arguments as a JSON object:

    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}

Text before [TOOL_CALLS] (or after the list or a call) is content; a list that is not valid JSON, or holds anything
but calls, and a v11 call whose name or arguments are not one, stay content with their marker. Call ids are 9
letters and digits, as Mistral's chat templates require of the ids sent back to them ("Tool call IDs should be
alphanumeric strings with length 9!"); a v11 model's own id is not kept.
Sources: vLLM's vllm/entrypoints/openai/tool_parsers/mistral_tool_parser.py (the pre-v11 format, and the ids, after
mistral_common's validator), examples/tool_chat_template_mistral.jinja, and mistral_common's
InstructTokenizerV11/V13 `_encode_tool_calls_in_assistant_message` (the v11+ tokens, in that order).
[TOOL_CALLS] is a special token in Mistral's HF tokenizers, which the detokenizer skips by default: chat requests
parsed by this parser keep special tokens in their text (SamplingParams.skip_special_tokens False), as vLLM does.
"""

from __future__ import annotations

import re
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
# v11+: a function name as OpenAI allows them, then optionally [CALL_ID] and the model's id, then [ARGS] (tokenizers
# from v13 write no id; a detokenizer that skips special tokens drops the markers, leaving name{...}).
_HEADER = re.compile(r"(?P<name>[A-Za-z0-9_-]{1,64})(?:\[CALL_ID\][A-Za-z0-9]+)?(?:\[ARGS\])?")
_MAYBE_HEADER = re.compile(r"[A-Za-z0-9_\-\[\]]{1,128}")  # what the text before "{" may hold while undecided
_NAME_START = re.compile(r"[A-Za-z0-9_-]")
_ID_CHARACTERS = string.ascii_letters + string.digits


class MistralScanner:
    def __init__(self) -> None:
        self._state = "text"  # text, lead (after the marker), list; v11+: header (name and markers), arguments
        self._text = ""  # not decided yet
        self._lead = ""  # whitespace between the marker and the list, or (v11+) the call's name and markers
        self._name = ""  # (v11+) the name of the call whose arguments are being read
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
                if _NAME_START.match(self._text):  # v11+: the name right after the marker
                    self._state, self._lead = "header", ""
                    continue
                rest = self._text.lstrip()
                if not rest:
                    return pieces
                if rest[0] != "[":  # no list after the marker: content, marker and all
                    pieces += self._out.content(MARKER)
                    self._state = "text"
                    continue
                self._lead, self._text = self._text[: len(self._text) - len(rest)], rest
                self._state, self._end, self._scanned = "list", JsonValueEnd(), 0
            elif self._state == "header":  # v11+: name[CALL_ID]id[ARGS] up to the arguments' "{"
                brace = self._text.find("{")
                header = self._text if brace < 0 else self._text[:brace]
                if brace < 0 and _MAYBE_HEADER.fullmatch(header):
                    return pieces  # it may still become one
                found = _HEADER.fullmatch(header) if brace >= 0 else None
                if found is None:  # not a call: content, marker and all
                    pieces += self._out.content(MARKER)
                    self._state = "text"
                    continue
                self._name, self._lead, self._text = found["name"], header, self._text[brace:]
                self._state, self._end, self._scanned = "arguments", JsonValueEnd(), 0
            else:  # the list (before v11) or the arguments object (v11+): where its JSON ends
                end = self._end.feed(self._text[self._scanned :])
                if end < 0:
                    self._scanned = len(self._text)
                    return pieces
                end += self._scanned
                value, self._text = self._text[:end], self._text[end:]
                calls = _calls(value) if self._state == "list" else _call(self._name, value)
                pieces += self._out.calls(calls) if calls else self._out.content(MARKER + self._lead + value)
                self._state = "text"

    def finish(self) -> list[Piece]:
        rest, self._text = self._text, ""
        if self._state != "text":  # the text ended after the marker, before the list did
            rest = MARKER + self._lead + rest
        self._state = "text"
        return self._out.content(rest) + self._out.finish()


def _call(name: str, arguments: str) -> list[ToolCall]:
    """(v11+) The call of `name` with `arguments`; none unless they are a valid JSON object."""
    try:
        value = loads_json(arguments)
    except ValueError:
        return []
    call = call_from_object({"name": name, "arguments": value})
    return [call] if call is not None else []


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
