"""Measured memory bandwidth of a device: the denominator of the roofline fraction `omnirun bench` reports."""

from __future__ import annotations

import dataclasses
import time

import torch

from omnirun.platform import Platform


@dataclasses.dataclass(frozen=True)
class Bandwidth:
    copy_bytes_per_s: float  # a large device-to-device copy: bytes read + bytes written, per second
    read_bytes_per_s: float  # a large reduction: bytes read per second

    def as_dict(self) -> dict[str, float]:
        return {"copy_GBps": self.copy_bytes_per_s / 1e9, "read_GBps": self.read_bytes_per_s / 1e9}


def measure_bandwidth(platform: Platform, device: torch.device, nbytes: int = 1 << 30, repeats: int = 5) -> Bandwidth:
    """Best of `repeats` timed copies and sums over `nbytes`-sized buffers (large enough to defeat caches)."""
    # float32: every device reduces it at full speed (a bf16 sum converts on the way, which some CPUs do slowly).
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)

    def best_time(fn) -> float:
        fn()  # warm up (allocation, first touch, kernel load)
        platform.synchronize()
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            platform.synchronize()
            best = min(best, time.perf_counter() - start)
        return best

    copy = best_time(lambda: dst.copy_(src))
    read = best_time(src.sum)
    platform.empty_cache()
    return Bandwidth(copy_bytes_per_s=2 * nbytes / copy, read_bytes_per_s=nbytes / read)
