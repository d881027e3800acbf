"""A small snapshot of the engine's state, what /metrics reports: taken between steps, or read now and then.

An engine in another process sends one with each step's outputs; one in this process is read directly (plain
reads of integers the engine thread updates: each read is atomic, together they may be a step apart).
"""

from __future__ import annotations

import dataclasses

from omnirun.engine.engine import Engine


@dataclasses.dataclass(frozen=True)
class EngineStats:
    running: int  # requests holding KV pages
    waiting: int  # requests queued in the scheduler
    kv_pages_used: int
    kv_pages_cached: int  # kept only by the prefix cache (evicted when new tokens need them)
    kv_pages_total: int
    preemptions: int


def engine_stats(engine: Engine) -> EngineStats | None:
    """The engine's stats now; None once it is closed."""
    scheduler = engine.scheduler
    if scheduler is None:
        return None
    kv = engine.runner.kv
    allocator = kv.allocator
    return EngineStats(
        running=len(scheduler.running),
        waiting=len(scheduler.waiting),
        kv_pages_used=allocator.num_pages - kv.free_pages,
        kv_pages_cached=kv.free_pages - allocator.free_count,
        kv_pages_total=allocator.num_pages,
        preemptions=scheduler.num_preemptions,
    )
