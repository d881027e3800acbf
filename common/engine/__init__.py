"""The engine: continuous batching over the ModelRunner, and the `LLM` Python API."""

from __future__ import annotations

from omnirun.engine.engine import Engine, KVUsage
from omnirun.engine.llm import LLM, RequestStream
from omnirun.engine.loop import EngineLoop, StreamDelta
from omnirun.engine.request import FinishReason, Request, RequestOutput
from omnirun.engine.scheduler import Scheduler

__all__ = [
    "LLM",
    "Engine",
    "EngineLoop",
    "FinishReason",
    "KVUsage",
    "Request",
    "RequestOutput",
    "RequestStream",
    "Scheduler",
    "StreamDelta",
]
