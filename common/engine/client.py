"""What a front (the HTTP server) needs of an engine, whichever runs it: a thread of this process or a process of
its own (omnirun.engine.process). Requests go in with submit / abort; each one's StreamDeltas come back on the
channel given at submit, as `(request_id, StreamDelta | exception)` items, put from a thread of the engine's side.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol

from omnirun.engine.engine import KVUsage
from omnirun.engine.llm import LLM
from omnirun.engine.request import Request
from omnirun.engine.stats import EngineStats, engine_stats
from omnirun.sampling import SamplingParams


@dataclasses.dataclass(frozen=True)
class ModelFacts:
    """The fixed facts of the served model a front checks requests against and reports."""

    model: str  # the model's path or preset name
    context_length: int
    vocab_size: int


class EngineClient(Protocol):
    tokenizer: Any  # None: token-id prompts only
    facts: ModelFacts

    def encode(self, prompt: str | Sequence[int]) -> list[int]: ...

    def make_request(self, prompt_ids: Sequence[int], params: SamplingParams) -> Request:
        """A checked request (ConfigError for a bad one), not queued yet; its text is kept step by step."""

    def submit(self, requests: Sequence[Request], channel: Any) -> None:
        """Queue requests made by make_request; their deltas arrive on `channel` (an object with put())."""

    def abort(self, request_id: int) -> None:
        """End a request at the next step; its pages are freed. Unknown or finished ids are ignored."""

    def check_alive(self) -> None:
        """Raise EngineClosedError when the engine is gone (closed, crashed, killed)."""

    def stats(self) -> EngineStats | None:
        """The engine's state for /metrics (None: closed)."""

    def kv_usage(self) -> KVUsage: ...


class ThreadEngine:
    """An LLM's engine thread (EngineLoop), in this process: the Python API's engine, served as it is."""

    def __init__(self, llm: LLM):
        self.llm = llm
        self.tokenizer = llm.tokenizer
        runner = llm.runner
        self.facts = ModelFacts(runner.config.model, runner.context_length, runner.shape.vocab_size)

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        return self.llm.encode(prompt)

    def make_request(self, prompt_ids: Sequence[int], params: SamplingParams) -> Request:
        return self.llm.engine.make_request(prompt_ids, params, detokenize=self.tokenizer is not None)

    def submit(self, requests: Sequence[Request], channel: Any) -> None:
        for request in requests:
            self.llm.engine_loop.submit(request, channel, stream=True)

    def abort(self, request_id: int) -> None:
        self.llm.engine_loop.abort(request_id)

    def check_alive(self) -> None:
        self.llm.engine_loop.check_alive()

    def stats(self) -> EngineStats | None:
        return engine_stats(self.llm.engine)

    def kv_usage(self) -> KVUsage:
        return self.llm.kv_usage()


def as_engine_client(engine: LLM | EngineClient) -> EngineClient:
    """An LLM served in this process, or an engine client as it is (an EngineProcess)."""
    return ThreadEngine(engine) if isinstance(engine, LLM) else engine
