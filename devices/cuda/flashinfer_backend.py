"""The FlashInfer attention backend: flashinfer's paged decode and prefill kernels over omnirun's KV pool.

flashinfer is imported when the backend is built, never at `import omnirun`; it JIT-compiles each kernel variant
(dtypes, head dim, sliding window or not) with nvcc on first use and caches it under ~/.cache/flashinfer.

Our pool keeps one [slots, kv_heads, head_dim] buffer per layer for K and one for V; with slot = page * page_size +
offset, each is a [pages, page_size, kv_heads, head_dim] paged cache in flashinfer's "NHD" layout, passed as a
(k, v) tuple. flashinfer reads a batch's pages through a CSR page table (kv_indptr, kv_indices, kv_last_page_len),
built here once per forward from the request-to-token table: the lengths come from the batch's host copies, the
page ids are gathered on the device, so nothing waits on the GPU.

A wrapper's plan() fixes the sliding window, so each distinct window the layers use gets its own wrapper, planned
once per forward. Windows are learned from the layers as they run (a model's first forward, or a graph's warm-up
runs, plans them on first use) and planned up front from then on.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch

from omnirun.attention.backend import (
    AttentionBackend,
    AttentionContext,
    AttentionLayerSpec,
    require_grouped_heads,
    require_half_precision,
)
from omnirun.batch import ForwardBatch, ForwardMode
from omnirun.errors import ConfigError

# flashinfer's float workspace holds the partial results of split-KV; its docs recommend 128 MiB, SGLang uses more.
DEFAULT_WORKSPACE_BYTES = 256 << 20
# Plan metadata per window (flashinfer's own default size for the int workspace of one wrapper).
INT_WORKSPACE_BYTES = 8 << 20
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

Window = int | None


def paged_kv_table(
    req_to_token: torch.Tensor, rows: torch.Tensor, seq_lens_cpu: torch.Tensor, page_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """flashinfer's page table of a batch: (kv_indptr, kv_indices, kv_last_page_len), all int32.

    Request i reads rows[i] of `req_to_token` for its first seq_lens_cpu[i] positions. kv_indptr [batch + 1] and
    kv_last_page_len [batch] are host tensors (plan() reads them on the host anyway); kv_indices [pages] is
    gathered on the table's device: the page of a request's j-th page is the slot of its position j * page_size,
    divided by page_size.
    """
    lens = seq_lens_cpu.to(torch.int64)
    num_pages = (lens + page_size - 1) // page_size
    indptr = torch.zeros(lens.numel() + 1, dtype=torch.int64)
    torch.cumsum(num_pages, 0, out=indptr[1:])
    last_page_len = lens - (num_pages - 1) * page_size
    total = int(indptr[-1])
    device = req_to_token.device
    # One host-to-device copy; output_size keeps repeat_interleave from reading its total back from the device.
    pages_and_starts = torch.stack([num_pages, indptr[:-1]]).to(device, non_blocking=True)
    request = torch.repeat_interleave(torch.arange(lens.numel(), device=device), pages_and_starts[0], output_size=total)
    page_in_request = torch.arange(total, device=device) - pages_and_starts[1][request]
    slots = req_to_token[rows[request], page_in_request * page_size]
    indices = torch.div(slots, page_size, rounding_mode="floor").to(torch.int32)
    return indptr.to(torch.int32), indices, last_page_len.to(torch.int32)


def window_left(window: Window) -> int:
    """flashinfer's window_left: keys before the query it still sees (-1: all). Ours counts the query itself."""
    return -1 if window is None else window - 1


@dataclasses.dataclass
class _Step:
    """One forward's page table, and per sliding window the wrapper planned with it."""

    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    qo_indptr: torch.Tensor | None  # [batch + 1] int32 host: first new token of each request; None for DECODE
    wrapper_for: Callable[[Window], Any]  # the wrapper that serves a window in this step, before it is planned
    planned: dict[Window, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class _GraphBuffers:
    """Static page tables that captured decode graphs read, sized for the largest captured batch."""

    kv_indptr: torch.Tensor  # [max_batch + 1]
    kv_indices: torch.Tensor  # [max_batch * max_pages_per_request]
    kv_last_page_len: torch.Tensor  # [max_batch]
    wrappers: dict[tuple[int, Window], Any]  # (batch size, window) -> decode wrapper in CUDA-graph mode

    @property
    def max_batch_size(self) -> int:
        return self.kv_last_page_len.shape[0]


class FlashInferAttention(AttentionBackend):
    """Attention with flashinfer: BatchDecodeWithPagedKVCacheWrapper for DECODE, BatchPrefillWithPagedKVCacheWrapper
    (causal, over the cache after the new K/V are stored) for EXTEND.

    decode_tensor_cores: decode with the prefill kernel on tensor cores (None: when the GQA group is 4 or more, or
    the KV cache is fp8, as SGLang chooses). prefill_backend: flashinfer's prefill implementation ("fa2", or "auto"
    for FA3 on Hopper). workspace_bytes: the float workspace shared by every wrapper.
    """

    name = "flashinfer"
    supports_graph = True

    def __init__(
        self,
        context: AttentionContext,
        *,
        decode_tensor_cores: bool | None = None,
        prefill_backend: str = "fa2",
        workspace_bytes: int = DEFAULT_WORKSPACE_BYTES,
    ):
        super().__init__(context)
        import flashinfer  # the vendor import, only once this backend is chosen

        self._flashinfer = flashinfer
        kv = context.kv
        self._kv_dtype = kv.kv_cache.dtype
        self._check(context)
        self.page_size = kv.page_size
        group = context.num_heads // context.num_kv_heads
        if decode_tensor_cores is None:
            decode_tensor_cores = group >= 4 or self._kv_dtype in FP8_DTYPES
        self.decode_tensor_cores = decode_tensor_cores
        self.prefill_backend = prefill_backend
        self._workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=context.device)
        self._int_workspaces: dict[Window, torch.Tensor] = {}
        self._eager_decode: dict[Window, Any] = {}
        self._eager_prefill: dict[Window, Any] = {}
        self._graph: _GraphBuffers | None = None
        self._windows: list[Window] = []  # the windows the layers have asked for so far
        self._step: _Step | None = None
        # Recorded after each plan(): it fills the wrapper's pinned host buffer and queues its copy to the device.
        self._plans_copied = torch.cuda.Event()

    def _check(self, context: AttentionContext) -> None:
        require_half_precision(context, self.name)
        if self._kv_dtype != context.model_dtype and self._kv_dtype not in FP8_DTYPES:
            raise ConfigError(
                f"the flashinfer attention backend reads a KV cache in the model dtype or fp8, not {self._kv_dtype}: "
                "pass --kv-cache-dtype auto, fp8_e4m3 or fp8_e5m2"
            )
        require_grouped_heads(context)
        if context.kv.kv_cache.num_slots % context.kv.page_size:
            raise ConfigError(
                f"KV pool of {context.kv.kv_cache.num_slots} slots is not whole pages of {context.kv.page_size}"
            )

    # --- wrappers ---
    def _shared_workspaces(self, wrapper: Any, window: Window) -> Any:
        # Wrappers of one window never run in the same forward and each plan() rewrites its int workspace before
        # use, so they share one; wrappers of different windows run in the same forward, so each window has its own.
        if window not in self._int_workspaces:
            self._int_workspaces[window] = torch.empty(INT_WORKSPACE_BYTES, dtype=torch.uint8, device=self._device)
        wrapper.reset_workspace_buffer(self._workspace, self._int_workspaces[window])
        return wrapper

    @property
    def _device(self) -> torch.device:
        return self._workspace.device

    def _eager_decode_wrapper(self, window: Window) -> Any:
        if window not in self._eager_decode:
            wrapper = self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace, "NHD", use_tensor_cores=self.decode_tensor_cores
            )
            self._eager_decode[window] = self._shared_workspaces(wrapper, window)
        return self._eager_decode[window]

    def _eager_prefill_wrapper(self, window: Window) -> Any:
        if window not in self._eager_prefill:
            wrapper = self._flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                self._workspace, "NHD", backend=self.prefill_backend
            )
            self._eager_prefill[window] = self._shared_workspaces(wrapper, window)
        return self._eager_prefill[window]

    def _graph_decode_wrapper(self, batch_size: int, window: Window) -> Any:
        graph = self._graph_buffers(batch_size)
        key = (batch_size, window)
        if key not in graph.wrappers:
            # One wrapper per captured batch size: CUDA-graph mode fixes the batch size and the static page table.
            wrapper = self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace,
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=self.decode_tensor_cores,
                paged_kv_indptr_buffer=graph.kv_indptr[: batch_size + 1],
                paged_kv_indices_buffer=graph.kv_indices,
                paged_kv_last_page_len_buffer=graph.kv_last_page_len[:batch_size],
            )
            graph.wrappers[key] = self._shared_workspaces(wrapper, window)
        return graph.wrappers[key]

    # --- metadata ---
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        if batch.mode is ForwardMode.DECODE:
            self._start_step(batch.req_pool_indices, batch.seq_lens_cpu, None, self._eager_decode_wrapper)
            return
        extend_lens = batch.extend_seq_lens_cpu.to(torch.int32)
        qo_indptr = torch.zeros(extend_lens.numel() + 1, dtype=torch.int32)
        torch.cumsum(extend_lens, 0, out=qo_indptr[1:])
        self._start_step(batch.req_pool_indices, batch.seq_lens_cpu, qo_indptr, self._eager_prefill_wrapper)

    def _start_step(
        self,
        rows: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        qo_indptr: torch.Tensor | None,
        wrapper_for: Callable[[Window], Any],
    ) -> None:
        # With the engine's overlap schedule this step is planned while the last may still be queued: its plan
        # copies must have left the pinned buffers before plan() rewrites them (they come first, so this rarely waits).
        self._plans_copied.synchronize()
        table = paged_kv_table(self.context.kv.req_to_token.table, rows, seq_lens_cpu, self.page_size)
        self._step = _Step(*table, qo_indptr, wrapper_for)
        for window in self._windows:
            self._plan(window)

    def _plan(self, window: Window) -> Any:
        """Plan this step's wrapper for `window` (plan() is host work plus copies: never inside a graph capture)."""
        step, ctx = self._step, self.context
        wrapper = step.wrapper_for(window)
        # sm_scale 1 here, and each layer's scaling passed to run() as q_scale (run multiplies the two): a plan
        # serves every layer, and run() takes no sm_scale of its own.
        common = dict(
            window_left=window_left(window), q_data_type=ctx.model_dtype, kv_data_type=self._kv_dtype, sm_scale=1.0
        )
        if step.qo_indptr is None:
            wrapper.plan(
                step.kv_indptr,
                step.kv_indices,
                step.kv_last_page_len,
                ctx.num_heads,
                ctx.num_kv_heads,
                ctx.head_dim,
                self.page_size,
                **common,
            )
        else:
            wrapper.plan(
                step.qo_indptr,
                step.kv_indptr,
                step.kv_indices,
                step.kv_last_page_len,
                ctx.num_heads,
                ctx.num_kv_heads,
                ctx.head_dim,
                self.page_size,
                causal=True,
                **common,
            )
        self._plans_copied.record()
        step.planned[window] = wrapper
        if window not in self._windows:
            self._windows.append(window)
        return wrapper

    def _wrapper(self, layer: AttentionLayerSpec) -> Any:
        ctx = self.context
        if (layer.num_heads, layer.num_kv_heads, layer.head_dim) != (ctx.num_heads, ctx.num_kv_heads, ctx.head_dim):
            raise ValueError(f"flashinfer plans the model's attention shape; layer {layer.layer_id} differs from it")
        planned = self._step.planned.get(layer.sliding_window)
        return planned if planned is not None else self._plan(layer.sliding_window)

    # --- forward ---
    def _paged_cache(self, layer: AttentionLayerSpec) -> tuple[torch.Tensor, torch.Tensor]:
        k_cache, v_cache = self.context.kv.kv_cache.get_kv(layer.layer_id)
        shape = (-1, self.page_size, layer.num_kv_heads, layer.head_dim)
        return k_cache.view(shape), v_cache.view(shape)

    def _run(self, q: torch.Tensor, layer: AttentionLayerSpec) -> torch.Tensor:
        wrapper = self._wrapper(layer)
        heads = (-1, layer.num_heads, layer.head_dim)
        out = q.new_empty((q.shape[0], layer.num_heads * layer.head_dim))
        wrapper.run(q.contiguous().view(heads), self._paged_cache(layer), q_scale=layer.scaling, out=out.view(heads))
        return out

    def forward_extend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch
    ) -> torch.Tensor:
        self.store_kv(k, v, layer, batch)
        return self._run(q, layer)

    def forward_decode(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch
    ) -> torch.Tensor:
        self.store_kv(k, v, layer, batch)
        return self._run(q, layer)

    # --- graph hooks ---
    def init_graph_state(self, max_batch_size: int) -> None:
        max_pages = -(-self.context.max_context_len // self.page_size)
        device = self._device
        self._graph = _GraphBuffers(
            kv_indptr=torch.zeros(max_batch_size + 1, dtype=torch.int32, device=device),
            kv_indices=torch.zeros(max_batch_size * max_pages, dtype=torch.int32, device=device),
            kv_last_page_len=torch.ones(max_batch_size, dtype=torch.int32, device=device),
            wrappers={},
        )

    def init_forward_metadata_capture(self, batch: ForwardBatch) -> None:
        # The graph runner's capture batch: row 0, one key per request. Windows not yet known are planned in the
        # warm-up runs that precede the capture.
        wrapper_for = functools.partial(self._graph_decode_wrapper, batch.batch_size)
        self._start_step(batch.req_pool_indices, batch.seq_lens_cpu, None, wrapper_for)

    def init_forward_metadata_replay(self, batch: ForwardBatch, padded_batch_size: int) -> None:
        self._graph_buffers(padded_batch_size)
        batch_size = batch.batch_size
        if batch_size > padded_batch_size:
            raise ValueError(f"batch of {batch_size} requests replayed in a graph of {padded_batch_size}")
        pad = padded_batch_size - batch_size
        # Padding rows read one key of request row 0, as the graph runner pads; their output is discarded.
        rows = torch.cat([batch.req_pool_indices, batch.req_pool_indices.new_zeros(pad)])
        seq_lens_cpu = torch.cat([batch.seq_lens_cpu, batch.seq_lens_cpu.new_ones(pad)])
        wrapper_for = functools.partial(self._graph_decode_wrapper, padded_batch_size)
        # Re-plans every window's wrapper of this size in place: the same static buffers the graph captured.
        self._start_step(rows, seq_lens_cpu, None, wrapper_for)

    def _graph_buffers(self, batch_size: int) -> _GraphBuffers:
        return self._checked_graph_state(self._graph, batch_size)
