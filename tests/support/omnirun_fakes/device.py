"""Pieces for testing a device package without its hardware: a graph that records and replays, and a mixin that
makes the host stand in for one device.

A fake lane (`ci/run-lane npu-fake`, ...) runs the conformance suite through a device package's real code paths
with the vendor module replaced by a fake that computes on CPU tensors. The fake's graph API is built from
`RecordingGraph`: capture records every aten op the captured code dispatches, replay runs them again on the same
tensors and writes each result into the tensor the capture produced, so a replay reads its static inputs and
leaves its outputs where a real device graph would. What a real capture forbids, the recording refuses too: a
host read of a device value (`.item()`, `.tolist()`, printing a tensor) raises.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from omnirun.devices.cpu.host_memory import peak_rss, reset_peak_rss
from omnirun.facts import GraphAPI
from omnirun.host_event import HostEvent
from omnirun.memory import PagedKVCache

# Reading a device value on the host: impossible while a device graph is being captured.
_HOST_READS = (torch.ops.aten._local_scalar_dense.default,)


class _Recorder(TorchDispatchMode):
    def __init__(self, graph: RecordingGraph):
        super().__init__()
        self.graph = graph

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _HOST_READS:
            raise RuntimeError(
                f"{func} reads a device value on the host during graph capture, which a device graph cannot replay"
            )
        out = func(*args, **kwargs)
        # Containers are rebuilt so that later changes to a list the caller passed do not reach the replay:
        # like a real graph, the recording holds the host values as they were at capture.
        flat, spec = tree_flatten((args, kwargs))
        self.graph.ops.append((func, spec, flat, out))
        return out


class RecordingGraph:
    """Stands in for torch.cuda.CUDAGraph (and the NPU/XPU graphs that mirror it) on CPU tensors."""

    def __init__(self, keep_graph: bool = False):
        self.ops: list[tuple[Any, Any, list[Any], Any]] = []
        self.captures = 0
        self.replays = 0
        self._recorder: _Recorder | None = None
        self._pool: Any = None

    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
        if self._recorder is not None:
            raise RuntimeError("capture_begin called while this graph is already capturing")
        if self.ops:
            raise RuntimeError("this graph was captured already: call reset() first")
        self._pool = pool
        self._recorder = _Recorder(self)
        self._recorder.__enter__()

    def capture_end(self) -> None:
        if self._recorder is None:
            raise RuntimeError("capture_end called without capture_begin")
        self._recorder.__exit__(None, None, None)
        self._recorder = None
        self.captures += 1

    def replay(self) -> None:
        if self._recorder is not None or not self.captures:
            raise RuntimeError("replay of a graph that has not finished capturing")
        for func, spec, flat, captured in self.ops:
            args, kwargs = tree_unflatten(flat, spec)
            _write_back(func, captured, func(*args, **kwargs))
        self.replays += 1

    def reset(self) -> None:
        self.ops.clear()
        self.captures = 0

    def pool(self) -> Any:
        return self._pool


def _write_back(func: Any, captured: Any, result: Any) -> None:
    """Copy each freshly computed output into the tensor the capture returned (the graph's fixed output memory).
    Outputs that alias an input (views, in-place and out= ops) already sit in that memory. An op whose schema only
    may alias (`to.dtype` aliases when no cast is needed, else returns new memory) is checked by its memory."""
    returns = func._schema.returns
    captured_flat = captured if isinstance(captured, (tuple, list)) else [captured]
    result_flat = result if isinstance(result, (tuple, list)) else [result]
    for i, (old, new) in enumerate(zip(captured_flat, result_flat, strict=True)):
        may_alias = i < len(returns) and returns[i].alias_info is not None
        if isinstance(old, torch.Tensor) and not (may_alias and _same_memory(old, new)):
            old.copy_(new)


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


@contextlib.contextmanager
def recording_capture(graph: RecordingGraph, pool: Any = None, stream: Any = None, **kwargs: Any) -> Iterator[None]:
    """`torch.cuda.graph(graph, pool=None, stream=None, capture_error_mode=...)` for a RecordingGraph."""
    graph.capture_begin(pool=pool, capture_error_mode=kwargs.get("capture_error_mode", "global"))
    try:
        yield
    finally:
        graph.capture_end()


def new_pool() -> tuple[int, int]:
    """`graph_pool_handle()`: an opaque token graphs share their memory through."""
    return (0, id(object()))


def recording_graph_api(name: str) -> GraphAPI:
    return GraphAPI(name, new_graph=RecordingGraph, capture=recording_capture, new_pool=new_pool)


class HostStandsInForDevice:
    """Mixin for a fake lane's platform (put it before the real platform class): one device, index 0, that is the
    host. Its tensors are CPU tensors, its kernels finish before they return, and its memory is a fixed-size budget
    the KV pools of this process take from, so runners sized by the memory probe keep small pools."""

    fake_total_bytes: int = 1 << 30

    def device(self, index: int | None = None) -> torch.device:
        return torch.device("cpu")  # "cpu:0" compares unequal to a CPU tensor's device

    def current_device(self) -> int:
        return 0

    def set_device(self, index: int) -> None:
        if index != 0:
            raise ValueError(f"the fake {self.name} platform has one device (index 0), not {index}")

    def synchronize(self, index: int | None = None) -> None:
        """CPU kernels finish before they return."""

    def stream(self, index: int | None = None) -> torch.Stream:
        return torch.Stream("cpu")

    def event(self, enable_timing: bool = False) -> HostEvent:
        return HostEvent(enable_timing)

    def memory_info(self, index: int | None = None) -> tuple[int, int]:
        # The fake device's memory holds the KV pools of this process: a second runner sees what the first took.
        free = self.fake_total_bytes - PagedKVCache.reserved_bytes("cpu")
        return max(free, 1), self.fake_total_bytes

    def empty_cache(self) -> None:
        """torch's CPU allocator hands freed memory back by itself."""

    def peak_memory_allocated(self, index: int | None = None) -> int:
        return peak_rss()  # the process's peak resident memory stands for the device allocator's peak

    def reset_peak_memory(self, index: int | None = None) -> None:
        reset_peak_rss()
