"""The CPU memory probe against fake /proc and cgroup trees: the machine's figures, capped by a container limit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omnirun.devices.cpu.host_memory import host_memory_info, peak_rss, reset_peak_rss

GIB = 1 << 30
MIB = 1 << 20


def _proc(tmp_path: Path, total_kib: int, available_kib: int) -> Path:
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(
        f"MemTotal:       {total_kib} kB\nMemFree:         1000 kB\nMemAvailable:   {available_kib} kB\n"
    )
    (proc / "self" / "status").write_text("Name:\tpython\nVmHWM:\t    2048 kB\nVmRSS:\t    1024 kB\n")
    return proc


def test_machine_memory_without_cgroup(tmp_path):
    proc = _proc(tmp_path, total_kib=32 * 1024 * 1024, available_kib=20 * 1024 * 1024)
    free, total = host_memory_info(proc, tmp_path / "no-cgroup")
    assert (free, total) == (20 * GIB, 32 * GIB)


def test_cgroup_v2_limit_caps_total_and_free(tmp_path):
    proc = _proc(tmp_path, total_kib=64 * 1024 * 1024, available_kib=60 * 1024 * 1024)
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    (cgroup / "memory.max").write_text(f"{8 * GIB}\n")
    (cgroup / "memory.current").write_text(f"{3 * GIB}\n")
    (cgroup / "memory.stat").write_text(f"anon {2 * GIB}\ninactive_file {GIB}\n")
    # used = current - reclaimable page cache = 2 GiB, so 6 GiB of the 8 GiB limit are free.
    assert host_memory_info(proc, cgroup) == (6 * GIB, 8 * GIB)


def test_cgroup_v2_unlimited_is_ignored(tmp_path):
    proc = _proc(tmp_path, total_kib=16 * 1024 * 1024, available_kib=10 * 1024 * 1024)
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    (cgroup / "memory.max").write_text("max\n")
    assert host_memory_info(proc, cgroup) == (10 * GIB, 16 * GIB)


def test_cgroup_v1_limit_and_unlimited(tmp_path):
    proc = _proc(tmp_path, total_kib=64 * 1024 * 1024, available_kib=60 * 1024 * 1024)
    cgroup = tmp_path / "cgroup"
    (cgroup / "memory").mkdir(parents=True)
    (cgroup / "memory" / "memory.limit_in_bytes").write_text(f"{4 * GIB}\n")
    (cgroup / "memory" / "memory.usage_in_bytes").write_text(f"{GIB}\n")
    (cgroup / "memory" / "memory.stat").write_text("total_inactive_file 0\n")
    assert host_memory_info(proc, cgroup) == (3 * GIB, 4 * GIB)
    (cgroup / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert host_memory_info(proc, cgroup) == (60 * GIB, 64 * GIB)


def test_peak_rss_reads_vmhwm_and_reset_tolerates_read_only_procfs(tmp_path):
    proc = _proc(tmp_path, total_kib=1024, available_kib=512)
    assert peak_rss(proc) == 2048 * 1024
    (proc / "self" / "clear_refs").mkdir()  # writing to a directory fails like a read-only procfs
    reset_peak_rss(proc)


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc/self/clear_refs")
def test_the_peak_counts_an_allocation_served_from_freed_heap_pages():
    # Freed small blocks stay resident in glibc's heap; a large block carved from them raises no resident size
    # unless the reset gave those pages back to the kernel first.
    raised_threshold = torch.ones(30 * MIB, dtype=torch.uint8)  # freeing it lifts glibc's mmap threshold to 30 MiB
    del raised_threshold
    small = [torch.ones(MIB, dtype=torch.uint8) for _ in range(300)]  # from the heap now, not mmap
    last = small[-1]  # pins the heap's top, so the 299 freed blocks below it stay resident
    del small
    reset_peak_rss()
    before = peak_rss()
    block = torch.ones(128 * MIB, dtype=torch.uint8)
    assert peak_rss() >= before + 0.9 * block.numel()
    del block, last


def test_real_machine_figures_are_sane():
    free, total = host_memory_info()
    assert 0 < free <= total
    assert peak_rss() > 0


def test_own_use_is_counted_exactly_while_the_kernel_lags():
    from omnirun.devices.cpu.host_memory import OwnUseTracker

    tracker = OwnUseTracker(free_at_start=10 * GIB, resident_at_start=1 * GIB)
    # this process wrote 3 GiB; the kernel's figure moved by only 1.5 GiB so far
    assert tracker.free(kernel_free=int(8.5 * GIB), resident_now=4 * GIB) == 7 * GIB
    # and freed 2 of them; the kernel has not caught up at all
    assert tracker.free(kernel_free=int(8.5 * GIB), resident_now=2 * GIB) == 9 * GIB


def test_another_processs_use_is_taken_from_the_kernel():
    from omnirun.devices.cpu.host_memory import OwnUseTracker

    tracker = OwnUseTracker(free_at_start=10 * GIB, resident_at_start=1 * GIB)
    assert tracker.free(kernel_free=5 * GIB, resident_now=1 * GIB) == 5 * GIB  # 5 GiB went elsewhere
    assert tracker.free(kernel_free=5 * GIB, resident_now=2 * GIB) == 4 * GIB  # counted on from there
