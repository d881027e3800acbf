"""Mistral tool calls, in both of the formats Mistral's tokenizers write. Before v11 (Mistral 7B Instruct v0.3), the
[TOOL_CALLS] token, then a JSON list of calls:

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]

From v11 (Mistral Small 3.1 and later), each call is [TOOL_CALLS], its name, the [CALL_ID] token and an id (v11
only), the [ARGS] token, and its arguments as a JSON object:

    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}

Text before [TOOL_CALLS] (or after the list or a call) is content. A call begins once its header is read: a list
item's `{"name": "<name>", "arguments": {` (the keys in that order), or v11's name and markers up to the arguments'
`{`; a stream then sends its name, and its arguments as they come, up to where their JSON value closes (the model's
own text, unchecked). Text that never becomes a call stays content, its marker with it: no list after the marker,
a first item that is no call's header, a v11 name or markers that are not one. What a stream has sent cannot be
taken back, so the calls before stay calls: from a later item that is no call (its "," with it), or from anything
but `}` and "," or "]" after a call's arguments, the text is content; a message cut inside the arguments ends with
them cut. Call ids are 9 letters and digits, as Mistral's chat templates require of the ids sent back to them ("Tool
call IDs should be alphanumeric strings with length 9!"); a v11 model's own id is not kept.
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
    ArgumentsReader,
    CallBegins,
    ContentAround,
    Piece,
    ToolParser,
    split_at_marker,
)
from omnirun.server.tool_parsers.json_scan import read_call_header

MARKER = "[TOOL_CALLS]"
# v11+: a function name as OpenAI allows them, then optionally [CALL_ID] and the model's id, then [ARGS] (tokenizers
# from v13 write no id; a detokenizer that skips special tokens drops the markers, leaving name{...}).
_HEADER = re.compile(r"(?P<name>[A-Za-z0-9_-]{1,64})(?:\[CALL_ID\][A-Za-z0-9]+)?(?:\[ARGS\])?")
_MAYBE_HEADER = re.compile(r"[A-Za-z0-9_\-\[\]]{1,128}")  # what the text before "{" may hold while undecided
_NAME_START = re.compile(r"[A-Za-z0-9_-]")
# Before v11: a list item's end after its arguments, the object's "}" then "," or the list's "]"
_ITEM_END = re.compile(r"[ \t\n\r]*\}(?P<next>[ \t\n\r]*[,\]])")
_MAYBE_ITEM_END = re.compile(r"[ \t\n\r]*(?:\}[ \t\n\r]*)?")
_ID_CHARACTERS = string.ascii_letters + string.digits


class MistralScanner:
    def __init__(self) -> None:
        # text, lead (after the marker); before v11: item (a list item's header), arguments, item_end; v11+: header
        # (name and markers), arguments
        self._state = "text"
        self._text = ""  # not decided yet
        self._lead = ""  # before an item: what is content if no call follows (the marker and "[", or a ",")
        self._in_list = False  # the arguments being read are a list item's
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
            before, after, held = split_at_marker(self._text, MARKER)
            pieces += self._out.content(before)
            if after is None:
                self._text = held
                return False
            self._state, self._text = "lead", after
        elif self._state == "lead":
            if _NAME_START.match(self._text):  # v11+: the name right after the marker
                self._state = "header"
                return True
            rest = self._text.lstrip()
            if not rest:
                return False
            if rest[0] != "[":  # no list after the marker: content, marker and all
                pieces += self._out.content(MARKER)
                self._state = "text"
                return True
            self._lead = MARKER + self._text[: len(self._text) - len(rest) + 1]
            self._state, self._text = "item", rest[1:]
        elif self._state == "header":  # v11+: name[CALL_ID]id[ARGS] up to the arguments' "{"
            brace = self._text.find("{")
            header = self._text if brace < 0 else self._text[:brace]
            if brace < 0 and _MAYBE_HEADER.fullmatch(header):
                return False  # it may still become one
            found = _HEADER.fullmatch(header) if brace >= 0 else None
            if found is None:  # not a call: content, marker and all
                pieces += self._out.content(MARKER)
                self._state = "text"
                return True
            self._begin(pieces, found["name"], self._text[brace:], in_list=False)
        elif self._state == "item":  # before v11: a list item's `{"name": ..., "arguments": {`
            name, end = read_call_header(self._text, ("arguments",))
            if end == 0:
                return False
            if end < 0:  # no call: content from the item on, with what led to it
                pieces += self._out.content(self._lead)
                self._state = "text"
                return True
            self._begin(pieces, name, self._text[end - 1 :], in_list=True)
        elif self._state == "arguments":
            more, rest = self._arguments.feed(self._text)
            pieces += more
            if rest is None:
                self._text = ""
                return False
            self._state, self._text = "item_end" if self._in_list else "text", rest
        else:  # item_end: the call object's "}", then the next item or the list's end
            found = _ITEM_END.match(self._text)
            if found is None and _MAYBE_ITEM_END.fullmatch(self._text):
                return False
            if found is None:  # the call stands (it was sent); what follows its arguments is content
                self._state = "text"
            elif found["next"].endswith("]"):
                self._state, self._text = "text", self._text[found.end() :]
            else:
                self._state, self._lead, self._text = "item", found["next"], self._text[found.end() :]
        return True

    def _begin(self, pieces: list[Piece], name: str, arguments: str, *, in_list: bool) -> None:
        """A call's header is read: the call begins, its arguments (from their "{") are read next."""
        pieces += self._out.call(CallBegins(name))
        self._state, self._text, self._in_list, self._arguments = "arguments", arguments, in_list, ArgumentsReader()

    def finish(self) -> list[Piece]:
        rest, self._text = self._text, ""
        if self._state in ("lead", "header"):  # the text ended after the marker, before a call began
            rest = MARKER + rest
        elif self._state == "item":
            rest = self._lead + rest
        elif self._state == "item_end":  # only the end of the last call's object (its "}") was missing
            rest = ""
        self._state = "text"
        return self._out.content(rest) + self._out.finish()


class MistralParser(ToolParser):
    name = "mistral"
    needs_special_tokens = True

    def scanner(self) -> MistralScanner:
        return MistralScanner()

    def new_call_id(self) -> str:
        return "".join(secrets.choice(_ID_CHARACTERS) for _ in range(9))
