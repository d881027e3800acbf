"""A generation request as the engine tracks it, and what the user gets back."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from omnirun.engine.detokenizer import IncrementalDetokenizer
from omnirun.sampling import SamplingParams


class FinishReason(str, enum.Enum):
    STOP = "stop"  # an EOS / stop token, or a stop string
    LENGTH = "length"  # max_new_tokens, or the context length
    ABORT = "abort"  # aborted by the caller (abort(), a closed stream, Ctrl-C), or failed with the engine


@dataclasses.dataclass
class Request:
    request_id: int
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = dataclasses.field(default_factory=list)
    # KV state: its row in the KV memory (None while waiting) and how many of its tokens are cached there.
    row: int | None = None
    num_cached: int = 0
    # Tokens sampled on the device that the host has not read yet: with overlap scheduling, the next step is
    # scheduled while the previous one runs, so a request may be one or two tokens ahead of `output_ids`.
    num_pending: int = 0
    # Prefix cache: the tree node it locks, how many of its leading tokens the cache holds, and how many prompt
    # tokens were found there when it first started (reported as cached tokens).
    cache_node: Any = None
    num_in_cache: int = 0
    cached_tokens: int = 0
    finish_reason: FinishReason | None = None
    # Output text kept step by step, for stop strings and streams (None: decoded once at the end, if at all).
    detokenizer: IncrementalDetokenizer | None = None
    logprobs: list[float] = dataclasses.field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)
    # With SamplingParams.prompt_logprobs: per prompt position (None for the first, and until computed), filled by
    # position, so that recomputing a prompt after a preemption writes the same values again.
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    num_preemptions: int = 0
    # With SamplingParams.structured_output: its GrammarMatcher (omnirun.structured), advanced by each output token.
    grammar: Any = None
    # Timestamps (time.perf_counter) for latency reports.
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None

    def __post_init__(self) -> None:
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None] * len(self.prompt_ids)
            self.prompt_top_logprobs = [None] * len(self.prompt_ids) if self.params.prompt_logprobs else None

    @property
    def needs_prompt_logits(self) -> bool:
        """Whether the tokens of its next prefill chunk need their logits (prompt logprobs not all computed yet)."""
        return self.prompt_logprobs is not None and self.num_cached < len(self.prompt_ids) - 1

    @property
    def all_ids(self) -> list[int]:
        """Prompt and output so far: what the KV cache must hold before the next token can be sampled."""
        return self.prompt_ids + self.output_ids

    @property
    def last_id(self) -> int:
        """The newest known token (what a decode step feeds), without building `all_ids`."""
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def length_reached(self, context_length: int, ahead: int = 0) -> bool:
        """Whether the output, with `ahead` more tokens (pending ones, say), ends the request by length."""
        limit = self.params.max_new_tokens
        if limit is not None and len(self.output_ids) + ahead >= limit:
            return True
        return self.num_tokens + ahead >= context_length


@dataclasses.dataclass
class RequestOutput:
    """The result of one prompt, as vLLM users know it."""

    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str | None
    logprobs: list[float] | None = None  # of each output token, when SamplingParams.logprobs is set
    top_logprobs: list[list[tuple[int, float]]] | None = None  # (token id, logprob) of the top-n at each step
    # Of each prompt token (None for the first), and the top-n at each prompt position, with prompt_logprobs set.
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    num_preemptions: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    ttft_s: float | None = None  # time to first token
    latency_s: float | None = None  # arrival to finish

    @classmethod
    def of(cls, req: Request, text: str | None) -> RequestOutput:
        wants_logprobs = req.params.logprobs is not None
        return cls(
            request_id=req.request_id,
            prompt_token_ids=list(req.prompt_ids),
            token_ids=list(req.output_ids),
            text=text,
            finish_reason=req.finish_reason.value if req.finish_reason else None,
            logprobs=list(req.logprobs) if wants_logprobs else None,
            top_logprobs=[list(t) for t in req.top_logprobs] if wants_logprobs and req.params.logprobs else None,
            prompt_logprobs=None if req.prompt_logprobs is None else list(req.prompt_logprobs),
            prompt_top_logprobs=None if req.prompt_top_logprobs is None else list(req.prompt_top_logprobs),
            num_preemptions=req.num_preemptions,
            cached_tokens=req.cached_tokens,
            ttft_s=None if req.first_token_time is None else req.first_token_time - req.arrival_time,
            latency_s=None if req.finish_time is None else req.finish_time - req.arrival_time,
        )
