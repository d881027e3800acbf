"""Measured memory bandwidth of a device: the denominator of the roofline fraction `omnirun bench` reports."""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # the platform is handed in: annotated, never imported here
    from omnirun.platform import Platform


@dataclasses.dataclass(frozen=True)
class Bandwidth:
    copy_bytes_per_s: float  # a large device-to-device copy: bytes read + bytes written, per second
    read_bytes_per_s: float  # a large reduction: bytes read per second

    def as_dict(self) -> dict[str, float]:
        return {"copy_GBps": self.copy_bytes_per_s / 1e9, "read_GBps": self.read_bytes_per_s / 1e9}


def measure_bandwidth(platform: Platform, device: torch.device, nbytes: int = 2 << 30, repeats: int = 10) -> Bandwidth:
    """Median of `repeats` timed copies and sums over `nbytes`-sized buffers (far larger than any cache).

    The median, not the best: on shared hosts single runs stray both ways (seen here: 22 to 62 GB/s around a
    steady 33 GB/s on a 2-core VM), and the roofline fraction should not hinge on one lucky run."""
    # float32: every device reduces it at full speed (a bf16 sum converts on the way, which some CPUs do slowly).
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)

    def median_time(fn) -> float:
        fn()  # warm up (first touch of the pages, kernel load)
        platform.synchronize()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            platform.synchronize()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    copy = median_time(lambda: dst.copy_(src))
    read = median_time(src.sum)
    platform.empty_cache()
    return Bandwidth(copy_bytes_per_s=2 * nbytes / copy, read_bytes_per_s=nbytes / read)
