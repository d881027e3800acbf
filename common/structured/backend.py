"""The interface a grammar library implements for the engine: compile a GrammarSpec once (cached), then one
matcher per request that says which tokens may come next and follows the tokens sampled."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from omnirun.errors import StructuredOutputError
from omnirun.structured.spec import GrammarSpec


class GrammarMatcher(Protocol):
    def accept_token(self, token: int) -> bool:
        """Advance by a sampled token; False if the grammar does not allow it (the state is then unchanged)."""

    def is_terminated(self) -> bool:
        """Whether the output is complete (the grammar has accepted a stop token)."""


class GrammarBackend(Protocol):
    name: str

    def matcher(self, spec: GrammarSpec) -> GrammarMatcher:
        """A fresh matcher of `spec`, compiled on first use and cached by spec (StructuredOutputError if invalid)."""

    def fill_bitmasks(self, matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor, rows: Sequence[int]) -> None:
        """Write the tokens matchers[i] allows next into row rows[i] of an int32 [B, ceil(V / 32)] host bitmask
        (bit t % 32 of word t // 32 set: token t allowed), for every i at once (a library may spread the rows
        over threads)."""


class LazyGrammarBackend:
    """The grammar backend over a tokenizer, made at the first constrained request (from whichever thread comes
    first): importing and preparing xgrammar costs nothing to an engine that never sees a constraint."""

    def __init__(self, tokenizer: Any | None, vocab_size: int, stop_token_ids: Sequence[int]):
        self._args = (tokenizer, vocab_size, list(stop_token_ids))
        self._backend: GrammarBackend | None = None
        self._lock = threading.Lock()

    def matcher(self, spec: GrammarSpec) -> GrammarMatcher:
        with self._lock:
            if self._backend is None:
                tokenizer, vocab_size, stop_token_ids = self._args
                if tokenizer is None:
                    raise StructuredOutputError("structured output needs a tokenizer: load the model with one")
                from omnirun.structured.xgrammar_backend import XGrammarBackend

                self._backend = XGrammarBackend(tokenizer, vocab_size, stop_token_ids)
        return self._backend.matcher(spec)

    def fill_bitmasks(self, matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor, rows: Sequence[int]) -> None:
        assert self._backend is not None, "a matcher comes first"  # (every matcher was made by this backend)
        self._backend.fill_bitmasks(matchers, bitmask, rows)
