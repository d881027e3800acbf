"""The engine: continuous batching over the ModelRunner, and the `LLM` Python API."""

from __future__ import annotations

from omnirun.engine.engine import Engine
from omnirun.engine.llm import LLM, StreamDelta
from omnirun.engine.request import FinishReason, Request, RequestOutput
from omnirun.engine.scheduler import Scheduler

__all__ = ["LLM", "Engine", "FinishReason", "Request", "RequestOutput", "Scheduler", "StreamDelta"]
