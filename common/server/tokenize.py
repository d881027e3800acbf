"""Tokenizing a text prompt for the routes (in a worker thread: see completions._prepare and chat._prepare), with
a guard for texts of megabytes.

Tokenizing 5 MB takes seconds, mostly in the tokenizer's Rust half, which releases the GIL; but freeing its result
for millions of tokens takes a quarter of a second that holds the GIL, and so the event loop (/health, every open
stream). A text far longer than the context could hold is therefore tokenized a prefix first: if that prefix alone
is twice the context length in tokens, the prompt is refused from it, without the whole text's tokens ever existing
(cutting a text changes its tokens only near the cut: the whole has about as many as its prefix, or more). Every
other prompt is tokenized whole, as before.
"""

from __future__ import annotations

from collections.abc import Callable

from omnirun.errors import ConfigError

# The prefix tokenized first, in characters per token of the context (English runs about 4 characters a token).
PREFIX_CHARS_PER_TOKEN = 16


def encode_checked(tokenize: Callable[[str], list[int]], text: str, context_length: int) -> list[int]:
    """`tokenize(text)`, or ConfigError (a 400) for a text whose prefix alone is far past `context_length`."""
    limit = context_length * PREFIX_CHARS_PER_TOKEN
    if len(text) > limit:
        head = len(tokenize(text[:limit]))
        if head >= 2 * context_length:
            raise ConfigError(
                f"the prompt is {len(text)} characters and its first {limit} alone are {head} tokens, far past the "
                f"context length {context_length}: shorten the prompt or raise --context-length"
            )
    return tokenize(text)
