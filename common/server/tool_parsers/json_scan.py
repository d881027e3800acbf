"""Where a JSON object or array ends, in text that arrives in pieces."""

from __future__ import annotations


class JsonValueEnd:
    """Counts brackets outside strings (a string's brackets and escaped quotes do not count) from the value's opening
    bracket on. It does not check the JSON, only finds its end: json.loads then judges the whole value."""

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
