"""The one line `omnirun serve` logs once it is ready: what it serves, on what, with which limits, and where.

Fields are `key=value`, for a person reading the log and for a grep (tests read the address from it).
"""

from __future__ import annotations

import shlex
from typing import Any

from omnirun.engine import LLM


def engine_description(engine: Any) -> dict[str, Any]:
    """The settled start-up facts of an engine in this process (an LLM) or in its own (an EngineProcess, whose
    child sent them when it was ready)."""
    if isinstance(engine, LLM):
        runner = engine.runner
        return {**runner.describe(), "warmup_s": engine.warmup_s, "engine": "thread"}
    return {**engine.description, "engine": "process", "engine_pid": engine.pid}


def summary_line(served_model_name: str, model: str, description: dict[str, Any], address: str) -> str:
    d = description
    fields = {
        "model": model,
        "served_as": served_model_name,
        "device": d["device"],
        "dtype": d["dtype"],
        "weights": d.get("weights") if d.get("weights") != d["dtype"] else None,  # a quantized checkpoint's format
        "experts": d.get("experts"),  # a mixture of experts' routing and placement
        "kv_cache_dtype": d["kv_cache_dtype"],
        "kv_tokens": d["kv_tokens"],
        "context_length": d["context_length"],
        "max_running_requests": d["max_running_requests"],
        "graphs": d["graph_runner"],  # the graph runner's class, or "eager"
        "deterministic": d["deterministic"],
        "warmup_s": None if d.get("warmup_s") is None else f"{d['warmup_s']:.1f}",  # absent: no warm-up ran
        "engine": d["engine"],  # "thread", or "process" (then its pid too)
        "engine_pid": d.get("engine_pid"),
        "address": address,
    }
    return "serving: " + " ".join(f"{key}={shlex.quote(str(v))}" for key, v in fields.items() if v is not None)
