"""Where a JSON object or array ends, and where a call object's opening ends, in text that arrives in pieces."""

from __future__ import annotations

import json
import re

_SPACE = "[ \t\n\r]*"  # JSON's whitespace
_STRING = r'"(?:[^"\\\x00-\x1f]|\\.)*'  # a JSON string's text up to its closing quote
_TOKEN = re.compile(f'{_SPACE}(?:[{{:,]|{_STRING}")')
_UNFINISHED = re.compile(f"{_SPACE}(?:{_STRING}\\\\?)?")  # what may still become the next token
_NAME = None  # in a header's shape: the call's name, any string but ""


class JsonValueEnd:
    """Counts brackets outside strings (a string's brackets and escaped quotes do not count) from the value's opening
    bracket on. It does not check the JSON, only finds its end."""

    def __init__(self) -> None:
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def feed(self, text: str) -> int:
        """The index in `text` just past the value's closing bracket, or -1 while the value goes on."""
        for i, char in enumerate(text):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth <= 0:
                    return i + 1
        return -1


def read_call_header(text: str, argument_keys: tuple[str, ...]) -> tuple[str, int]:
    """A call object's opening at the start of `text`: `{"name": "<name>", "<one of argument_keys>": {`, JSON
    whitespace allowed around its tokens, the keys in that order (as the models write them). `(name, end)` with
    `end` just past the brace that opens the arguments; `("", 0)` while the text may still become one, `("", -1)`
    once it cannot. Called again with the longer text as it arrives (a header is short)."""
    at, name = 0, ""
    for want in ("{", ("name",), ":", _NAME, ",", argument_keys, ":", "{"):
        token = _TOKEN.match(text, at)
        if token is None:
            return "", 0 if _UNFINISHED.fullmatch(text, at) else -1
        at, got = token.end(), token.group().lstrip(" \t\n\r")
        if want is _NAME:
            name = _string(got) or ""
            fits = bool(name)
        elif isinstance(want, tuple):
            fits = _string(got) in want
        else:
            fits = got == want
        if not fits:
            return "", -1
    return name, at


def _string(token: str) -> str | None:
    """The value of a JSON string token; None for other tokens, a bad escape, or a lone surrogate (which cannot go
    out as UTF-8)."""
    if not token.startswith('"'):
        return None
    try:
        value = json.loads(token)
        value.encode()
    except (ValueError, UnicodeEncodeError):
        return None
    return value
