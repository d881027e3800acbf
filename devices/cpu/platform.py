"""The CPU platform: the host processor, its memory read from the OS, gloo for collectives.

Where a CPU build of intel-extension-for-pytorch is installed and matches torch (IPEX X.Y needs torch X.Y), it
adds the `ipex` attention backend (on request: torch_native stays the default until ipex is measured against it)
and IPEX's rms norms as fused ops (device_shared/ipex_*.py, shared with the xpu platform). Without one, nothing changes.
"""

from __future__ import annotations

import platform as _host
from collections.abc import Callable
from typing import Any

import torch

from omnirun.device_shared.ipex_support import IPEX, ipex_notes, ipex_status
from omnirun.devices.cpu.host_memory import OwnUseTracker, host_memory_info, peak_rss, reset_peak_rss, resident_bytes
from omnirun.facts import AttentionOffer, Capabilities, ProbeResult
from omnirun.host_event import HostEvent
from omnirun.memory import PagedKVCache
from omnirun.platform import Platform


class CpuPlatform(Platform):
    api_version = 2
    name = "cpu"
    torch_device_type = "cpu"
    visible_devices_env = None
    distributed_backend = "gloo"
    extra = "cpu"
    auto_priority = 0  # the fallback: auto picks it only when no accelerator is available
    # Host memory is shared with the OS and every other process: claim less of it than of an accelerator's.
    default_mem_fraction_static = 0.4
    # The KV pool's size unless a flag sizes it, as vLLM's CPU backend (VLLM_CPU_KVCACHE_SPACE, 4 GiB): 40 % of the
    # host for a 3 MB model left the machine no room, and a second LLM of the process none at all.
    default_kv_cache_space = 4 << 30
    _own_use: OwnUseTracker | None = None  # set by the first memory_info()
    _ranks_per_node = 1  # processes sharing this host as tensor-parallel ranks (bind_rank)
    _threads_before_bind: int | None = None

    def _probe(self) -> ProbeResult:
        return ProbeResult.ok(1)

    def _capabilities(self) -> Capabilities:
        return Capabilities(
            device_name=_cpu_model_name(),
            model_dtypes=_model_dtypes(),
            # torch stores and converts fp8 on the CPU; compute upcasts.
            fp8_e4m3_dtype=torch.float8_e4m3fn,
            fp8_e5m2_dtype=torch.float8_e5m2,
            supports_triton=False,
        )

    # A CPU tensor's device is plain "cpu"; "cpu:0" compares unequal to it.
    def device(self, index: int | None = None) -> torch.device:
        return torch.device("cpu")

    def current_device(self) -> int:
        return 0

    def set_device(self, index: int) -> None:
        if index != 0:
            raise ValueError(f"the cpu platform has one device (index 0), not {index}")

    def synchronize(self, index: int | None = None) -> None:
        torch.cpu.synchronize()

    def stream(self, index: int | None = None) -> torch.Stream:
        return torch.Stream("cpu")

    def event(self, enable_timing: bool = False) -> HostEvent:
        return HostEvent(enable_timing)

    def bind_rank(self, local_rank: int, ranks_per_node: int) -> int:
        """Every rank of a node shares the host: each takes its share of the cores and of the memory budget."""
        if self._threads_before_bind is None:
            self._threads_before_bind = torch.get_num_threads()
        self._ranks_per_node = max(1, ranks_per_node)
        torch.set_num_threads(max(1, self._threads_before_bind // self._ranks_per_node))
        return 0

    def unbind_rank(self) -> None:
        self._ranks_per_node = 1
        if self._threads_before_bind is not None:
            torch.set_num_threads(self._threads_before_bind)
            self._threads_before_bind = None

    def memory_info(self, index: int | None = None) -> tuple[int, int]:
        free, total = self._host_memory_info()
        # Ranks of one node each size a pool from the same host memory: give each an equal share.
        return free // self._ranks_per_node, total // self._ranks_per_node

    def default_kv_cache_bytes(self) -> int:
        """This rank's default KV pool size: ranks of one node share the host, as in memory_info."""
        return self.default_kv_cache_space // self._ranks_per_node

    def _host_memory_info(self) -> tuple[int, int]:
        free, total = host_memory_info()
        if self._own_use is None:
            self._own_use = OwnUseTracker(free, resident_bytes())
        free = self._own_use.free(free, resident_bytes())
        # A KV pool's pages are committed when first written: count the pools of this process as taken from the
        # start, or a second runner would size its pool from memory the first one has already claimed.
        return max(free - PagedKVCache.reserved_bytes("cpu"), 0), total

    def device_fused_ops(self) -> dict[str, Callable[..., Any]]:
        from omnirun.devices.cpu import packed_linear

        ops = {"linear": packed_linear.linear, "prepare_linear": packed_linear.prepare_linear}
        if ipex_status("cpu").usable:
            from omnirun.device_shared.ipex_ops import ipex_fused_ops  # imports IPEX

            ops.update(ipex_fused_ops("cpu", fallback={}))
        return ops

    # --- IPEX, where a matching CPU build is installed ---
    def attention_offers(self) -> tuple[AttentionOffer, ...]:
        # torch_native is the default (measured here, bench/results/cpu_*.json); ipex only on request until it is
        # measured too. IPEX's CPU kernels take float32 as well.
        if not ipex_status("cpu").usable:
            return ()
        # imports no IPEX until a backend is built
        from omnirun.device_shared.ipex_attention import build_ipex_attention

        return (AttentionOffer(IPEX, build_ipex_attention("cpu"), on_request=True),)

    def notes(self) -> tuple[str, ...]:
        return ipex_notes("cpu")

    def empty_cache(self) -> None:
        """Nothing to do: torch's CPU allocator hands freed memory back to the OS itself."""

    def peak_memory_allocated(self, index: int | None = None) -> int:
        """Peak resident memory of the whole process: torch does not track CPU allocations by itself."""
        return peak_rss()

    def reset_peak_memory(self, index: int | None = None) -> None:
        reset_peak_rss()


def _model_dtypes() -> tuple[torch.dtype, ...]:
    """All three compute; bf16 comes first only where the cores compute it natively (AVX512-BF16 or AMX)."""
    if torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported():
        return (torch.bfloat16, torch.float32, torch.float16)
    return (torch.float32, torch.bfloat16, torch.float16)


def _cpu_model_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return _host.processor() or _host.machine()
