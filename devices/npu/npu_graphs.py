"""Decode graphs on Ascend: torch_npu's NPUGraph, captured in auto-dispatch mode so host arguments can be rewritten.

ATB operators (the paged attention of ascend_attention.py) read some arguments on the host when they are launched:
`_npu_paged_attention` takes the context lengths as a CPU int32 tensor. A captured graph keeps the values of the
capture. torch_npu's answer is `torch.npu.graph(g, pool, stream, auto_dispatch_capture=True)`, which records each
such operator in a task group, and `g.update(cpu_update_input=[{"context_lens": lens}])`, which re-issues them with
new host values before a replay (Ascend/pytorch:torch_npu/npu/graphs.py::NPUGraph.update, _GraphDispatchMode;
the "context_lens" key of `_npu_paged_attention` is declared in torch_npu/npu/_npugraph_handlers/simple_handler.py;
SGLang calls it so in python/sglang/srt/hardware_backend/npu/graph_runner/npu_graph_runner.py::replay).

An attention backend names, while a graph is being captured, the static host buffer that holds such an argument
(`note_host_input`); the graph keeps it and passes its current values to `update` before every replay. The backend
refreshes that buffer in `init_forward_metadata_replay`, which the decode graph runner calls just before replay.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch

from omnirun.facts import GraphAPI

GRAPH_NAME = "npu_graph"
_capture = threading.local()  # the NpuGraph being captured on this thread, if any


class NpuGraph:
    """torch_npu.npu.NPUGraph plus the static host buffers its ATB operators read (rewritten at each replay)."""

    def __init__(self, npu: Any):
        self.graph = npu.NPUGraph()
        self.host_inputs: dict[str, torch.Tensor] = {}

    def replay(self) -> None:
        if self.host_inputs:
            # One dict: torch_npu applies it to every recorded operator, each taking the keys it declares.
            self.graph.update(cpu_update_input=[dict(self.host_inputs)])
        self.graph.replay()

    def reset(self) -> None:
        self.graph.reset()
        self.host_inputs.clear()

    def pool(self) -> Any:
        return self.graph.pool()


def note_host_input(name: str, buffer: torch.Tensor) -> None:
    """While a graph is being captured on this thread: `buffer` (a host tensor the caller refreshes before each
    replay) is the value of operator argument `name` at replay. A no-op outside a capture."""
    graph = getattr(_capture, "graph", None)
    if graph is None:
        return
    known = graph.host_inputs.setdefault(name, buffer)
    if known is not buffer and not (known.data_ptr() == buffer.data_ptr() and known.shape == buffer.shape):
        raise RuntimeError(f"two host buffers for {name!r} in one NPU graph: update() sets one value for all operators")


def npu_graph_api(torch_npu: Any) -> GraphAPI:
    """NPUGraph / graph / graph_pool_handle of torch_npu.npu (Ascend/pytorch:torch_npu/npu/graphs.py)."""
    npu = torch_npu.npu

    @contextlib.contextmanager
    def capture(graph: NpuGraph, pool: Any = None, stream: Any = None) -> Iterator[None]:
        _capture.graph = graph
        try:
            with npu.graph(graph.graph, pool=pool, stream=stream, auto_dispatch_capture=True):
                yield
        finally:
            _capture.graph = None

    return GraphAPI(GRAPH_NAME, new_graph=lambda: NpuGraph(npu), capture=capture, new_pool=npu.graph_pool_handle)
