"""The aiter attention backend: AMD's aiter kernels over omnirun's paged KV pool, graph-capturable decode.

aiter is imported when the backend is built, never at `import omnirun`. Decode runs aiter's ragged paged attention
the way SGLang's aiter backend calls it (sgl-project/sglang:python/sglang/srt/layers/attention/aiter_backend.py,
forward_decode): the pool viewed as pages of one token in the "NHD" layout, a token-granular CSR table
(kv_indptr, kv_indices), a partition count fixed from the longest context and an fp32 workspace sized for it, so
that one captured graph serves every sequence length. Prefill and extend gather each request's cached and new
K/V (dequantised to the model dtype) and run aiter's varlen flash attention, causal from the bottom right, as
vLLM's aiter backend does for a cached prefix
(vllm-project/vllm:vllm/v1/attention/backends/rocm_aiter_fa.py, AiterFlashAttentionImpl.forward).

A sliding window limits a decode query to its last `window` keys: each window the layers use gets its own table
that starts there (learned from the layers as they run; a graph's warm-up runs learn them before the capture).
"""

from __future__ import annotations

import dataclasses

import torch

from omnirun.attention.backend import (
    AttentionBackend,
    AttentionContext,
    AttentionLayerSpec,
    require_grouped_heads,
    require_half_precision,
)
from omnirun.batch import ForwardBatch, ForwardMode
from omnirun.devices.rocm.token_table import token_table, window_starts
from omnirun.errors import ConfigError

# The tokens one workgroup of the decode kernel reduces (SGLang's _AITER_PARTITION_SIZE_ROCM).
PARTITION_SIZE = 256

Window = int | None


def kv_cache_dtype_arg(kv_dtype: torch.dtype, model_dtype: torch.dtype, aiter_fp8: torch.dtype) -> str:
    """aiter's kv_cache_dtype argument for a pool stored in `kv_dtype`: "auto" (the model dtype), or "fp8_e4m3"
    for aiter's fp8 (aiter.dtypes.fp8: e4m3fnuz on gfx942, e4m3fn on gfx950; ROCm/aiter:aiter/utility/dtypes.py),
    the only fp8 its decode kernel reads (ROCm/aiter:csrc/cpp_itfs/pa/pa_ragged.py raises on any other)."""
    if kv_dtype == model_dtype:
        return "auto"
    if kv_dtype == aiter_fp8:
        return "fp8_e4m3"
    raise ConfigError(
        f"the aiter attention backend reads a KV cache in the model dtype or {str(aiter_fp8).removeprefix('torch.')} "
        f"(this GPU's e4m3), not {str(kv_dtype).removeprefix('torch.')}: pass --kv-cache-dtype auto or fp8_e4m3, "
        "or choose another --attention-backend"
    )


def workspace_bytes(batch_size: int, num_heads: int, partitions: int, head_dim: int) -> int:
    """The decode kernel's scratch: fp32 exp-sums and max-logits per partition, then the partial outputs
    (ROCm/aiter:csrc/cpp_itfs/pa/pa_ragged.cpp.jinja), sized in fp32 as SGLang sizes them (safe for any dtype)."""
    return batch_size * num_heads * partitions * (head_dim + 2) * 4


@dataclasses.dataclass
class _Table:
    indptr: torch.Tensor  # [batch + 1] int32
    indices: torch.Tensor  # [keys] int32 KV slots


@dataclasses.dataclass
class _DecodeStep:
    rows: torch.Tensor  # [batch] request rows (padded for a graph)
    seq_lens_cpu: torch.Tensor  # [batch] host lengths (padded for a graph)
    workspace: torch.Tensor
    last_page_lens: torch.Tensor  # [batch] int32 ones: pages of one token
    tables: dict[Window, _Table]
    graph: _GraphBuffers | None = None  # the static buffers, when this step runs in a captured graph


@dataclasses.dataclass
class _ExtendStep:
    table: _Table  # every key of each request: its cached prefix, then its new tokens
    cu_seqlens_q: torch.Tensor  # [batch + 1] int32
    max_seqlen_q: int
    max_seqlen_k: int


@dataclasses.dataclass
class _GraphBuffers:
    """Static decode metadata that captured graphs read, sized for the largest captured batch."""

    workspace: torch.Tensor
    last_page_lens: torch.Tensor  # [max_batch] int32 ones
    tables: dict[Window, _Table]  # per window: indptr [max_batch + 1], indices [max_batch * max_context_len]

    @property
    def max_batch_size(self) -> int:
        return self.last_page_lens.shape[0]


class AiterAttention(AttentionBackend):
    name = "aiter"
    supports_graph = True

    def __init__(self, context: AttentionContext):
        super().__init__(context)
        import aiter  # the vendor import, only once this backend is chosen

        self._aiter = aiter
        require_half_precision(context, self.name)
        require_grouped_heads(context)
        self._kv_cache_dtype = kv_cache_dtype_arg(context.kv.kv_cache.dtype, context.model_dtype, aiter.dtypes.fp8)
        # The cache stores fp8 K/V through PagedKVCache.set_kv (divided by a checkpoint's scales, where it has them)
        # and the attention layer folds those scales into the softmax scale and the output: the kernels' are ones.
        self._kv_scale = torch.ones(1, dtype=torch.float32, device=context.device)
        self._partitions = -(-context.max_context_len // PARTITION_SIZE)
        self._decode: _DecodeStep | None = None
        self._extend: _ExtendStep | None = None
        self._graph: _GraphBuffers | None = None
        self._scratch: tuple[torch.Tensor, torch.Tensor] | None = None  # eager workspace and ones, grown

    # --- metadata ---
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        table = self.context.kv.req_to_token.table
        if batch.mode is ForwardMode.DECODE:
            workspace, ones = self._eager_scratch(batch.batch_size)
            self._decode = _DecodeStep(batch.req_pool_indices, batch.seq_lens_cpu, workspace, ones, {})
            return
        seq_lens = batch.seq_lens_cpu
        extend_lens = batch.extend_seq_lens_cpu.to(torch.int32)
        cu_seqlens_q = torch.zeros(extend_lens.numel() + 1, dtype=torch.int32)
        torch.cumsum(extend_lens, 0, out=cu_seqlens_q[1:])
        self._extend = _ExtendStep(
            _Table(*token_table(table, batch.req_pool_indices, torch.zeros_like(seq_lens), seq_lens)),
            cu_seqlens_q.to(table.device, non_blocking=True),
            int(extend_lens.max()) if extend_lens.numel() else 0,
            int(seq_lens.max()) if seq_lens.numel() else 0,
        )

    def _eager_scratch(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._scratch is None or self._scratch[1].shape[0] < batch_size:
            size = 1 << max(batch_size - 1, 0).bit_length()  # powers of two: few reallocations as batches grow
            self._scratch = self._new_scratch(size)
        workspace, ones = self._scratch
        return workspace, ones[:batch_size]

    def _new_scratch(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        ctx = self.context
        nbytes = workspace_bytes(batch_size, ctx.num_heads, self._partitions, ctx.head_dim)
        workspace = torch.empty(nbytes, dtype=torch.uint8, device=ctx.device)
        return workspace, torch.ones(batch_size, dtype=torch.int32, device=ctx.device)

    def _decode_table(self, window: Window) -> _Table:
        step = self._decode
        if window not in step.tables:
            graph = step.graph
            if graph is not None:  # a window first seen in a graph's warm-up: static buffers of its own
                graph.tables[window] = self._static_table(graph.max_batch_size)
                self._fill(graph.tables[window], step, window)
                step.tables[window] = self._view(graph.tables[window], step.rows.shape[0])
            else:
                starts = window_starts(step.seq_lens_cpu, window)
                table = self.context.kv.req_to_token.table
                step.tables[window] = _Table(*token_table(table, step.rows, starts, step.seq_lens_cpu))
        return step.tables[window]

    # --- forward ---
    def _check_layer(self, layer: AttentionLayerSpec) -> None:
        ctx = self.context
        if (layer.num_heads, layer.num_kv_heads, layer.head_dim) != (ctx.num_heads, ctx.num_kv_heads, ctx.head_dim):
            raise ValueError(f"aiter sizes its workspace for the model's attention; layer {layer.layer_id} differs")

    def forward_extend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch
    ) -> torch.Tensor:
        self._check_layer(layer)
        self.store_kv(k, v, layer, batch)
        step, dtype = self._extend, self.context.model_dtype
        k_cache, v_cache = self.context.kv.kv_cache.get_kv(layer.layer_id)
        slots = step.table.indices.long()
        # The cached prefix and the new tokens of each request, packed request after request (fp8 dequantised
        # with scale 1), as vLLM gathers a cached prefix before its varlen call.
        keys, values = k_cache[slots].to(dtype), v_cache[slots].to(dtype)
        heads = (-1, layer.num_heads, layer.head_dim)
        window = (-1, -1) if layer.sliding_window is None else (layer.sliding_window - 1, 0)
        # ROCm/aiter:aiter/ops/mha.py::flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
        # max_seqlen_k, ..., softmax_scale, ..., causal, window_size, ...): causal from the bottom right, so a
        # request's new tokens see its whole cached prefix; vllm-project/vllm:vllm/v1/attention/backends/
        # rocm_aiter_fa.py passes causal=True and window_size=(sliding_window - 1, 0) the same way.
        out = self._aiter.flash_attn_varlen_func(
            q.contiguous().view(heads),
            keys,
            values,
            step.cu_seqlens_q,
            step.table.indptr,
            step.max_seqlen_q,
            step.max_seqlen_k,
            softmax_scale=layer.scaling,
            causal=True,
            window_size=window,
        )
        return out.view(q.shape[0], layer.num_heads * layer.head_dim)

    def forward_decode(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch
    ) -> torch.Tensor:
        self._check_layer(layer)
        self.store_kv(k, v, layer, batch)
        step = self._decode
        table = self._decode_table(layer.sliding_window)
        k_cache, v_cache = self.context.kv.kv_cache.get_kv(layer.layer_id)
        pages = (-1, 1, layer.num_kv_heads, layer.head_dim)  # "NHD" pages of one token
        batch_size = q.shape[0]
        heads = (batch_size, layer.num_heads, layer.head_dim)
        out = q.new_empty((batch_size, layer.num_heads * layer.head_dim))
        # ROCm/aiter:aiter/ops/attention.py::paged_attention_ragged(out, workspace_buffer, query, key_cache,
        # value_cache, scale, kv_indptr, kv_page_indices, kv_last_page_lens, block_size, max_num_partitions,
        # alibi_slopes, kv_cache_dtype, kv_cache_layout, logits_soft_cap, k_scale, v_scale, fp8_out_scale,
        # partition_size), called as sgl-project/sglang:python/sglang/srt/layers/attention/aiter_backend.py
        # forward_decode does: pages of one token, "NHD", no soft cap, fp32 [1] scales.
        self._aiter.paged_attention_ragged(
            out.view(heads),
            step.workspace,
            q.contiguous().view(heads),
            k_cache.view(pages),
            v_cache.view(pages),
            layer.scaling,
            table.indptr,
            table.indices,
            step.last_page_lens,
            1,
            self._partitions,
            None,
            self._kv_cache_dtype,
            "NHD",
            0.0,
            self._kv_scale,
            self._kv_scale,
            None,
            PARTITION_SIZE,
        )
        return out

    # --- graph hooks ---
    def init_graph_state(self, max_batch_size: int) -> None:
        workspace, ones = self._new_scratch(max_batch_size)
        self._graph = _GraphBuffers(workspace, ones, {})

    def _static_table(self, max_batch_size: int) -> _Table:
        device = self.context.device
        return _Table(
            torch.zeros(max_batch_size + 1, dtype=torch.int32, device=device),
            torch.zeros(max_batch_size * self.context.max_context_len, dtype=torch.int32, device=device),
        )

    @staticmethod
    def _view(static: _Table, batch_size: int) -> _Table:
        return _Table(static.indptr[: batch_size + 1], static.indices)

    def _fill(self, static: _Table, step: _DecodeStep, window: Window) -> None:
        """Rewrite a window's static table in place from a (padded) batch: the memory the graphs captured."""
        starts = window_starts(step.seq_lens_cpu, window)
        indptr, indices = token_table(self.context.kv.req_to_token.table, step.rows, starts, step.seq_lens_cpu)
        static.indptr[: indptr.shape[0]].copy_(indptr, non_blocking=True)
        static.indices[: indices.shape[0]].copy_(indices, non_blocking=True)

    def _graph_step(self, rows: torch.Tensor, seq_lens_cpu: torch.Tensor) -> _DecodeStep:
        graph = self._checked_graph_state(self._graph, rows.shape[0])
        batch_size = rows.shape[0]
        step = _DecodeStep(rows, seq_lens_cpu, graph.workspace, graph.last_page_lens[:batch_size], {}, graph)
        for window, static in graph.tables.items():
            self._fill(static, step, window)
            step.tables[window] = self._view(static, batch_size)
        return step

    def init_forward_metadata_capture(self, batch: ForwardBatch) -> None:
        self._decode = self._graph_step(batch.req_pool_indices, batch.seq_lens_cpu)

    def init_forward_metadata_replay(self, batch: ForwardBatch, padded_batch_size: int) -> None:
        self._checked_graph_state(self._graph, padded_batch_size)
        if batch.batch_size > padded_batch_size:
            raise ValueError(f"batch of {batch.batch_size} requests replayed in a graph of {padded_batch_size}")
        pad = padded_batch_size - batch.batch_size
        # Padding rows read one key of request row 0, as the graph runner pads; their output is discarded.
        rows = torch.cat([batch.req_pool_indices, batch.req_pool_indices.new_zeros(pad)])
        seq_lens_cpu = torch.cat([batch.seq_lens_cpu, batch.seq_lens_cpu.new_ones(pad)])
        self._decode = self._graph_step(rows, seq_lens_cpu)
