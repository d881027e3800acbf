"""Grammar-constrained decoding: what a request's output must match (GrammarSpec), the backend that compiles it
and tracks each request's progress through it (xgrammar, behind GrammarBackend so another can be added), and the
token bitmask the sampler applies to the logits (the op table's `apply_token_bitmask`)."""

from omnirun.errors import StructuredOutputError
from omnirun.structured.backend import GrammarBackend, GrammarMatcher, LazyGrammarBackend
from omnirun.structured.spec import GrammarSpec

__all__ = ["GrammarBackend", "GrammarMatcher", "GrammarSpec", "LazyGrammarBackend", "StructuredOutputError"]
