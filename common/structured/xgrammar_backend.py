"""GrammarBackend on xgrammar (github.com/mlc-ai/xgrammar, what vLLM and SGLang use by default): a GrammarCompiler
over the model's tokenizer compiles each spec once (cached by spec here, and xgrammar caches by grammar text as
well), and a GrammarMatcher per request fills the token bitmask in the format the `apply_token_bitmask` op reads.

Compiling takes milliseconds to seconds for a large schema: the server calls `matcher` from a worker thread.
"""

from __future__ import annotations

import functools
import json
import re
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from omnirun.errors import StructuredOutputError
from omnirun.structured.spec import GrammarSpec

_CACHE_SIZE = 256  # distinct specs kept compiled


def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError:
        raise StructuredOutputError(
            "structured output needs xgrammar: pip install 'omnirun[structured]' (or xgrammar)"
        ) from None
    return xgrammar


class XGrammarMatcher:
    def __init__(self, matcher: Any, also_allowed: torch.Tensor | None = None):
        self._matcher = matcher
        self._also_allowed = also_allowed  # a bitmask row every fill is ANDed with (None: the grammar's alone)

    def accept_token(self, token: int) -> bool:
        return bool(self._matcher.accept_token(token))

    def is_terminated(self) -> bool:
        return bool(self._matcher.is_terminated())


class XGrammarBackend:
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]):
        xgr = _xgrammar()
        # vocab_size: the model's logits width (often padded past the tokenizer's): the bitmask covers all of it.
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids))
        self._compiler = xgr.GrammarCompiler(info)
        self._no_control_characters = _without_control_characters(info.decoded_vocab, vocab_size)
        self._lock = threading.Lock()  # (compiles from several server threads at once)
        self._compile = functools.lru_cache(maxsize=_CACHE_SIZE)(self._compile_uncached)
        # Fills a step's masks on several threads (xgrammar's BatchGrammarMatcher, as vLLM and SGLang fill them).
        self._batch = xgr.BatchGrammarMatcher()
        self.vocab_size = vocab_size

    def matcher(self, spec: GrammarSpec) -> XGrammarMatcher:
        with self._lock:
            compiled = self._compile(spec)
        # xgrammar's JSON strings take raw control characters, which JSON forbids (json.loads refuses them).
        json_kinds = spec.kind in ("json_schema", "json_object")
        return XGrammarMatcher(
            _xgrammar().GrammarMatcher(compiled), self._no_control_characters if json_kinds else None
        )

    def fill_bitmasks(self, matchers: Sequence[XGrammarMatcher], bitmask: torch.Tensor, rows: Sequence[int]) -> None:
        self._batch.batch_fill_next_token_bitmask([m._matcher for m in matchers], bitmask, list(rows))
        also = [row for m, row in zip(matchers, rows, strict=True) if m._also_allowed is not None]
        if also:
            bitmask[also] &= self._no_control_characters

    def _compile_uncached(self, spec: GrammarSpec) -> Any:
        compiler = self._compiler
        try:
            if spec.kind == "json_schema":
                # any_whitespace off: JSON with single spaces, so that a model cannot stall in whitespace.
                return compiler.compile_json_schema(spec.value, any_whitespace=False)
            if spec.kind == "json_object":  # OpenAI's json_object: an object (xgrammar's builtin takes any value)
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if spec.kind == "regex":
                return compiler.compile_regex(spec.value)
            if spec.kind == "structural_tag":  # its JSON parts exclude control characters themselves
                return compiler.compile_structural_tag(spec.value)
            if spec.kind == "choice":  # an EBNF of quoted alternatives (JSON's escapes are EBNF's)
                options = " | ".join(json.dumps(option) for option in json.loads(spec.value))
                return compiler.compile_grammar(f"root ::= {options}")
            return compiler.compile_grammar(spec.value)
        except (RuntimeError, ValueError) as exc:  # xgrammar's errors for a bad schema, regex or grammar
            lines = str(exc).strip().splitlines() or [type(exc).__name__]
            first = re.sub(r"^\[[0-9:]+\] \S+:[0-9]+: ", "", lines[0])  # (its C++ log prefix: time, file, line)
            what = spec.kind.replace("_", " ")
            raise StructuredOutputError(f"cannot compile the {what} constraint: {first}; fix it or drop it") from None


def _without_control_characters(vocab: Sequence[bytes], vocab_size: int) -> torch.Tensor:
    """A bitmask row allowing every token whose bytes hold no control character (below 0x20): JSON wants those
    escaped in strings, and with single spaces for whitespace (any_whitespace off) needs none outside them."""
    allowed = np.ones((vocab_size + 31) // 32 * 32, dtype=bool)
    for token, text in enumerate(vocab[:vocab_size]):
        allowed[token] = not any(byte < 0x20 for byte in text)
    # Bit t % 32 of word t // 32 is token t: little-endian bits in little-endian bytes.
    return torch.from_numpy(np.packbits(allowed, bitorder="little").view("<i4").copy())
