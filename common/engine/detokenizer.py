"""Text of a growing list of output tokens at constant work per token, and stop strings found in it.

Decoding the whole output again at every step costs O(n) per token. Instead (the technique of vLLM's
`detokenize_incrementally`, written anew here) each step decodes a short window: the tokens since the last
emitted boundary, with the window's first tokens decoded alone as its known prefix; the text past that prefix is
new. Starting the window a few tokens back keeps spaces and merges that depend on the previous token right. A
window whose text ends in U+FFFD (half of a multi-byte character) is held until the next token completes it.

Windows are decoded by the fast tokenizer's Rust backend where that is all `tokenizer.decode` does (no clean-up of
tokenization spaces): the same text without transformers' Python around each call (converting and checking the
ids), which was about a fifth of a busy server process's samples (py-spy, 1,024 streams on a CPU).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

_REPLACEMENT = "\ufffd"


def window_decoder(tokenizer: Any, skip_special_tokens: bool = True) -> Callable[[list[int]], str]:
    """`ids -> tokenizer.decode(ids, skip_special_tokens=...)`, by the Rust backend when that gives the same."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return functools.partial(tokenizer.decode, skip_special_tokens=skip_special_tokens)
    return functools.partial(backend.decode, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, stop: Sequence[str] = (), *, skip_special_tokens: bool = True):
        self._decode = window_decoder(tokenizer, skip_special_tokens)
        self._ids: list[int] = []
        self._prefix = 0  # the window starts here: decoded alone, it gives the text already emitted
        self._read = 0  # tokens before this one are in `text`
        self.text = ""
        self._stop = tuple(stop)
        self._stop_tail = max((len(s) for s in self._stop), default=1) - 1

    def add(self, token_ids: Sequence[int]) -> str:
        """Take new tokens; return the text they complete (possibly empty, while a character is unfinished)."""
        self._ids.extend(token_ids)
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        window_text = self._decode(self._ids[self._prefix :])
        if len(window_text) <= len(prefix_text) or window_text.endswith(_REPLACEMENT):
            return ""
        new = window_text[len(prefix_text) :]
        self._prefix, self._read = self._read, len(self._ids)
        self.text += new
        return new

    def flush(self) -> str:
        """The text of tokens still held back (an unfinished character decodes as U+FFFD); call once at the end."""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        rest = self._decode(self._ids[self._prefix :])[len(prefix_text) :]
        self._prefix = self._read = len(self._ids)
        self.text += rest
        return rest

    def find_stop(self, new_text_len: int) -> int:
        """Where the first stop string starts in `text`, or -1. Only the last `new_text_len` characters are new:
        a stop string found now must end in them, so only they and the tail a stop string may reach back into are
        searched (constant work per token)."""
        if not self._stop or not new_text_len:
            return -1
        start = max(len(self.text) - new_text_len - self._stop_tail, 0)
        hits = [i for i in (self.text.find(s, start) for s in self._stop) if i >= 0]
        return min(hits) if hits else -1

    def stable_length(self) -> int:
        """How much of `text` can be shown while the request runs: all but what could still be the start of a
        stop string."""
        return max(len(self.text) - self._stop_tail, 0)
