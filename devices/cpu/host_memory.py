"""Host memory as the CPU platform's memory probe: /proc/meminfo, capped by the container's cgroup limit."""

from __future__ import annotations

import ctypes
from pathlib import Path

_PROC = Path("/proc")
_CGROUP = Path("/sys/fs/cgroup")


def host_memory_info(proc: Path = _PROC, cgroup: Path = _CGROUP) -> tuple[int, int]:
    """(free, total) bytes this process may still use: the tighter of the machine and its cgroup limit."""
    meminfo = _read_kv(proc / "meminfo")
    total = meminfo["MemTotal"] * 1024
    free = meminfo.get("MemAvailable", meminfo["MemFree"]) * 1024
    limit = _cgroup_limit(cgroup)
    if limit is not None and limit[0] < total:
        cg_total, cg_used = limit
        total = cg_total
        free = min(free, max(cg_total - cg_used, 0))
    return free, total


def resident_bytes(proc: Path = _PROC) -> int:
    """Resident set size of this process in bytes (VmRSS)."""
    return _read_kv(proc / "self" / "status").get("VmRSS", 0) * 1024


class OwnUseTracker:
    """Free host memory counted from a starting reading of the kernel's figure and this process's own use since.

    The kernel's counters lag this process's allocations: in a VM here MemAvailable fell by half a GiB when a
    1 GiB tensor was written (and rose by as little when it was freed), while the resident size moved by exactly
    1 GiB. So the probe counts this process's own use exactly, and trusts the kernel only where it reports much
    less free memory than that count (another process took some): it then starts counting again from there.
    """

    SLACK = 1 << 30  # how far the kernel's figure may lag before it is taken to mean another process's use

    def __init__(self, free_at_start: int, resident_at_start: int):
        self.free_at_start = free_at_start
        self.resident_at_start = resident_at_start

    def free(self, kernel_free: int, resident_now: int) -> int:
        counted = self.free_at_start - (resident_now - self.resident_at_start)
        if kernel_free < counted - self.SLACK:
            self.free_at_start, self.resident_at_start = kernel_free, resident_now
            return kernel_free
        return counted


def peak_rss(proc: Path = _PROC) -> int:
    """Peak resident set size of this process in bytes (VmHWM)."""
    return _read_kv(proc / "self" / "status").get("VmHWM", 0) * 1024


def reset_peak_rss(proc: Path = _PROC) -> None:
    """Restart VmHWM from the current RSS (Linux: writing 5 to clear_refs); a no-op where not permitted.

    The heap's freed pages go back to the kernel first: glibc keeps them resident, and a later allocation served
    from them would not raise the resident size, so the peak would miss it (a 128 MiB tensor did, in CI).
    """
    _trim_heap()
    try:
        (proc / "self" / "clear_refs").write_text("5")
    except OSError:
        pass


def _trim_heap() -> None:
    """glibc's malloc_trim(0): unmap the free pages of every malloc arena; nothing where the C library lacks it."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)


def _cgroup_limit(cgroup: Path) -> tuple[int, int] | None:
    """(limit, used) of this container's memory cgroup, v2 or v1; None when unlimited or not found."""
    v2 = cgroup / "memory.max"
    if v2.exists():
        raw = v2.read_text().strip()
        if raw == "max":
            return None
        used = int((cgroup / "memory.current").read_text()) - _read_kv(cgroup / "memory.stat").get("inactive_file", 0)
        return int(raw), used
    v1 = cgroup / "memory" / "memory.limit_in_bytes"
    if v1.exists():
        limit = int(v1.read_text())
        if limit >= 1 << 60:  # v1 spells "unlimited" as a huge page-aligned number
            return None
        stat = _read_kv(cgroup / "memory" / "memory.stat")
        used = int((cgroup / "memory" / "memory.usage_in_bytes").read_text()) - stat.get("total_inactive_file", 0)
        return limit, used
    return None


def _read_kv(path: Path) -> dict[str, int]:
    """Parse 'Key: 123 kB' (procfs) or 'key 123' (cgroup) lines into ints; missing file → {}."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return {}
    values = {}
    for line in lines:
        parts = line.replace(":", " ").split()
        if len(parts) >= 2 and parts[1].isdigit():
            values[parts[0]] = int(parts[1])
    return values
