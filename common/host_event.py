"""An event for host-backed platforms (the cpu platform, plugins that compute on the host): torch has no CPU events,
and CPU kernels finish before they return, so a clock suffices."""

from __future__ import annotations

import time


class HostEvent:
    """The subset of torch.Event the runner uses: record, synchronize, query, elapsed_time (ms)."""

    def __init__(self, enable_timing: bool = False):
        self.enable_timing = enable_timing
        self._recorded_at: float | None = None

    def record(self, stream: object = None) -> None:
        self._recorded_at = time.perf_counter()

    def synchronize(self) -> None:
        """Nothing to wait for: the work before record() has already run."""

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: HostEvent) -> float:
        if not (self.enable_timing and end.enable_timing):
            raise RuntimeError("both events need enable_timing=True to measure elapsed time")
        if self._recorded_at is None or end._recorded_at is None:
            raise RuntimeError("both events must be recorded before elapsed_time()")
        return (end._recorded_at - self._recorded_at) * 1000.0
