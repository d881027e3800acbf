"""The device's memory probe: a device of fixed size, whose used part is what this process has taken of it.

A real device asks its driver (free, total). This example has no driver: it gives itself `capacity` bytes and
counts as used the growth of this process's resident memory since the device was first probed — so an allocation
of n bytes, once written, shows as n bytes less free, as on an accelerator — plus the KV pools not written yet
(host pages are committed on first touch, so resident memory alone would not see a fresh pool).
"""

from __future__ import annotations

from pathlib import Path

from omnirun.memory import PagedKVCache


def resident_bytes() -> int:
    """This process's resident set size (VmRSS) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise OSError("no VmRSS line in /proc/self/status")


class FixedSizeMemory:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self._baseline = resident_bytes()

    def info(self) -> tuple[int, int]:
        used = max(resident_bytes() - self._baseline, 0) + PagedKVCache.reserved_bytes("cpu")
        return max(self.capacity - used, 0), self.capacity
