"""The `ipex` attention backend: IPEX's paged-attention kernels (ipex.llm.modules.PagedAttention) over omnirun's pool.

Shared by the xpu and cpu platforms; intel_extension_for_pytorch is imported when the backend is built, and only
by a platform whose `ipex_status` says the installed IPEX matches torch (a mismatched IPEX exits the process).

Our pool keeps one [slots, kv_heads, head_dim] buffer per layer for K and one for V; with slot = page * page_size +
offset each is a [pages, page_size, kv_heads, head_dim] paged cache. IPEX's two builds read it differently:

- XPU build: `reshape_and_cache_flash` and `flash_attn_varlen_func` (torch_ipex.chunked_prefill) take the NHD
  layout [pages, page_size, kv_heads, head_dim], contiguous: our buffers as they are. Its decode kernel
  (`single_query_cached_kv_attention`, torch_ipex.paged_attention) wants [pages, kv_heads, head_dim, page_size]
  with pages of 16 or 32 (IPEX's XeTLA paged_attention_v1.cpp, tests/gpu/examples/test_paged_attention.py),
  which our pool is not; so decode runs `flash_attn_varlen_func` with one query per request, as vLLM's v1 XPU path
  does (vllm-project/vllm@0fa99d44: vllm/attention/utils/fa_utils.py maps flash_attn_varlen_func to
  vllm/_ipex_ops.py::ipex_ops.flash_attn_varlen_func for prefill and decode alike). Its kernels compute in
  bf16/fp16 only (sdp_utils.h::aten_to_Xetla_dtype).
- CPU build: `reshape_and_cache`, `single_query_cached_kv_attention` (decode) and `flash_attn_varlen_func`
  (prefill over a cached prefix) read the cache through its strides as [pages, kv_heads, page_size, head_dim]
  (csrc/cpu/aten/kernels/PagedAttentionKrnl.cpp: size(1) heads, stride(2) the token stride): our buffers
  viewed with dims 1 and 2 swapped, no copy. fp8 caches only as float8_e5m2.

Page tables are int32 [batch, pages] built on the device from the request-to-token table; lengths come from the
batch's host copies, so nothing waits on the device. Decode metadata can live in static buffers for graphs.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

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

Build = Literal["xpu", "cpu"]
# IPEX's kv_cache_dtype strings per storage dtype, by build (CacheOps.cpp DISPATCH_BY_KV_CACHE_DTYPE on XPU;
# _IPEXPagedAttentionCPU.reshape_and_cache accepts e5m2 only).
KV_CACHE_DTYPES: dict[Build, dict[torch.dtype, str]] = {
    "xpu": {torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2"},
    "cpu": {torch.float8_e5m2: "fp8_e5m2"},
}
# XPU: IPEX pads head dims that are not a multiple of this through block_table.unique(), whose size the host must
# learn (a device sync): such steps cannot be captured in a graph.
XPU_GRAPH_HEAD_DIM_MULTIPLE = 64


def graph_capturable(build: Build, head_dim: int) -> bool:
    """Whether a decode step of this backend can be captured in a device graph."""
    return build == "cpu" or head_dim % XPU_GRAPH_HEAD_DIM_MULTIPLE == 0


@dataclasses.dataclass
class _Metadata:
    """One forward's tables on the device, and the host numbers IPEX takes as ints."""

    block_table: torch.Tensor  # [batch, pages] int32
    cu_seqlens_q: torch.Tensor  # [batch + 1] int32
    cu_seqlens_kv: torch.Tensor  # [batch + 1] int32
    context_lens: torch.Tensor  # [batch] int32 (the CPU decode kernel's lengths)
    max_seqlen_q: int
    max_seqlen_kv: int


@dataclasses.dataclass
class _GraphBuffers:
    block_table: torch.Tensor  # [max_batch, max_pages]
    cu_seqlens_q: torch.Tensor  # [max_batch + 1]: 0, 1, 2, ... (one query per request)
    cu_seqlens_kv: torch.Tensor  # [max_batch + 1]
    context_lens: torch.Tensor  # [max_batch]

    @property
    def max_batch_size(self) -> int:
        return self.context_lens.shape[0]


class IpexAttention(AttentionBackend):
    name = "ipex"

    def __init__(self, context: AttentionContext, build: Build):
        super().__init__(context)
        import intel_extension_for_pytorch as ipex  # the vendor import, only once this backend is chosen

        self._paged = ipex.llm.modules.PagedAttention
        self.build = build
        self.page_size = context.kv.page_size
        self._kv_cache_dtype = self._check(context)
        group = context.num_heads // context.num_kv_heads
        # The CPU decode kernel maps each query head to its KV head through this table.
        self._head_mapping = torch.arange(context.num_kv_heads, dtype=torch.int32, device=context.device)
        self._head_mapping = self._head_mapping.repeat_interleave(group)
        self._meta: _Metadata | None = None
        self._graph: _GraphBuffers | None = None

    @property
    def supports_graph(self) -> bool:  # type: ignore[override]
        return graph_capturable(self.build, self.context.head_dim)

    def _check(self, context: AttentionContext) -> str:
        kv_dtype, model_dtype = context.kv.kv_cache.dtype, context.model_dtype
        if self.build == "xpu":
            require_half_precision(context, self.name, " on xpu (IPEX's XeTLA kernels)")
        require_grouped_heads(context)
        if kv_dtype == model_dtype:
            return "auto"
        fp8 = KV_CACHE_DTYPES[self.build]
        if kv_dtype not in fp8 or (self.build == "cpu" and model_dtype == torch.float16):
            # IPEX's CPU cache writer converts to e5m2 from float32 or bfloat16 only (PagedAttentionKrnl.cpp).
            choices = ", ".join(["auto", *(v for v in fp8.values())])
            raise ConfigError(
                f"the ipex attention backend on {self.build} cannot read a {kv_dtype} KV cache with a {model_dtype} "
                f"model: pass --kv-cache-dtype {choices}"
            )
        return fp8[kv_dtype]

    # --- the paged cache as IPEX reads it ---
    def _caches(self, layer: AttentionLayerSpec) -> tuple[torch.Tensor, torch.Tensor]:
        k_cache, v_cache = self.context.kv.kv_cache.get_kv(layer.layer_id)
        shape = (-1, self.page_size, layer.num_kv_heads, layer.head_dim)
        k_cache, v_cache = k_cache.view(shape), v_cache.view(shape)
        if self.build == "cpu":  # [pages, kv_heads, page_size, head_dim] through strides
            return k_cache.transpose(1, 2), v_cache.transpose(1, 2)
        return k_cache, v_cache

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch) -> None:
        if self.context.kv.kv_cache.scales(layer.layer_id) != (1.0, 1.0):
            # A scaled fp8 cache: IPEX's XPU cache ops leave the scales unimplemented (CacheOps.cpp), so torch's
            # store, into the same buffers (IPEX's views of them above).
            return super().store_kv(k, v, layer, batch)
        shape = (-1, layer.num_kv_heads, layer.head_dim)
        k_cache, v_cache = self._caches(layer)
        args = (k.view(shape), v.view(shape), k_cache, v_cache, batch.out_cache_loc, self._kv_cache_dtype, 1.0, 1.0)
        if self.build == "xpu":
            # PagedAttention.reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype,
            # k_scale, v_scale): NHD caches (intel/intel-extension-for-pytorch@v2.8.10+xpu:
            # intel_extension_for_pytorch/llm/modules/mha_fusion.py; csrc/gpu/aten/operators/CacheOps.cpp).
            self._paged.reshape_and_cache_flash(*args)
        else:
            # PagedAttention.reshape_and_cache(<same>): block = slot // key_cache.size(2) (v2.8.0+cpu:
            # transformers/models/cpu/fusions/mha_fusion.py::_IPEXPagedAttentionCPU; PagedAttentionKrnl.cpp).
            self._paged.reshape_and_cache(*args)

    # --- metadata ---
    def _block_table(self, rows: torch.Tensor, num_pages: int) -> torch.Tensor:
        """[rows, num_pages] int32: the page of each request's j-th page (the slot of its position j * page_size)."""
        table = self.context.kv.req_to_token.table
        slots = table[rows][:, : num_pages * self.page_size : self.page_size]
        return torch.div(slots, self.page_size, rounding_mode="floor").to(torch.int32)

    def _pages(self, max_len: int) -> int:
        return max(1, -(-max_len // self.page_size))

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        device = self.context.device
        seq_lens = batch.seq_lens_cpu.to(torch.int32)
        q_lens = torch.ones_like(seq_lens) if batch.mode is ForwardMode.DECODE else batch.extend_seq_lens_cpu
        host = torch.zeros(3, seq_lens.numel() + 1, dtype=torch.int32)
        torch.cumsum(q_lens.to(torch.int32), 0, out=host[0, 1:])
        torch.cumsum(seq_lens, 0, out=host[1, 1:])
        host[2, :-1] = seq_lens
        on_device = host.to(device, non_blocking=True)  # one copy for the three
        max_kv = int(seq_lens.max()) if seq_lens.numel() else 1
        self._meta = _Metadata(
            block_table=self._block_table(batch.req_pool_indices, self._pages(max_kv)),
            cu_seqlens_q=on_device[0],
            cu_seqlens_kv=on_device[1],
            context_lens=on_device[2, :-1],
            max_seqlen_q=int(q_lens.max()) if q_lens.numel() else 1,
            max_seqlen_kv=max_kv,
        )

    # --- forward ---
    def _varlen(self, q: torch.Tensor, layer: AttentionLayerSpec) -> torch.Tensor:
        meta = self._meta
        k_cache, v_cache = self._caches(layer)
        query = q.contiguous().view(-1, layer.num_heads, layer.head_dim)
        out = torch.empty_like(query)
        window_left = -1 if layer.sliding_window is None else layer.sliding_window - 1
        # PagedAttention.flash_attn_varlen_func(output, query, key_cache, value_cache, cu_seqlens_q, cu_seqlens_kv,
        # max_seqlen_q, max_seqlen_kv, scale, is_cusal, block_tables, alibi_slopes, window_size_left,
        # window_size_right, kv_cache_dtype, k_scale, v_scale): causal aligned to the bottom right, so the new
        # tokens see the cached prefix (mha_fusion.py at v2.8.10+xpu and v2.8.0+cpu; called the same way by
        # vllm-project/vllm@1a37f4fb: vllm/_ipex_ops.py::flash_attn_varlen_func).
        self._paged.flash_attn_varlen_func(
            out,
            query,
            k_cache,
            v_cache,
            meta.cu_seqlens_q,
            meta.cu_seqlens_kv,
            meta.max_seqlen_q,
            meta.max_seqlen_kv,
            layer.scaling,
            True,
            meta.block_table,
            None,
            window_left,
            -1,
            self._kv_cache_dtype,
            1.0,
            1.0,
        )
        return out.view(q.shape[0], -1)

    def _single_query(self, q: torch.Tensor, layer: AttentionLayerSpec) -> torch.Tensor:
        meta = self._meta
        k_cache, v_cache = self._caches(layer)
        query = q.contiguous().view(-1, layer.num_heads, layer.head_dim)
        out = torch.empty_like(query)
        # PagedAttention.single_query_cached_kv_attention(output, query, key_cache, value_cache, head_mapping, scale,
        # block_tables, context_lens, block_size, max_context_len, alibi_slopes, window_size=-1, ...); the CPU
        # frontend has no kv_cache_dtype argument, so the rest go by keyword (mha_fusion.py at v2.8.0+cpu).
        self._paged.single_query_cached_kv_attention(
            out,
            query,
            k_cache,
            v_cache,
            self._head_mapping,
            layer.scaling,
            meta.block_table,
            meta.context_lens,
            self.page_size,
            meta.max_seqlen_kv,
            None,
            window_size=-1,
        )
        return out.view(q.shape[0], -1)

    def forward_extend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch
    ) -> torch.Tensor:
        self.store_kv(k, v, layer, batch)
        return self._varlen(q, layer)

    def forward_decode(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch
    ) -> torch.Tensor:
        self.store_kv(k, v, layer, batch)
        if self.build == "cpu" and layer.sliding_window is None:
            return self._single_query(q, layer)
        # The XPU decode kernel needs another cache layout (module docstring); a sliding window goes through the
        # varlen kernel on the CPU too, whose window convention (keys before the query) is flash-attention's.
        return self._varlen(q, layer)

    # --- graph hooks ---
    def init_graph_state(self, max_batch_size: int) -> None:
        device, max_pages = self.context.device, self._pages(self.context.max_context_len)
        self._graph = _GraphBuffers(
            block_table=torch.zeros(max_batch_size, max_pages, dtype=torch.int32, device=device),
            cu_seqlens_q=torch.arange(max_batch_size + 1, dtype=torch.int32, device=device),
            cu_seqlens_kv=torch.arange(max_batch_size + 1, dtype=torch.int32, device=device),
            context_lens=torch.ones(max_batch_size, dtype=torch.int32, device=device),
        )

    def _graph_metadata(self, batch_size: int) -> _Metadata:
        graph = self._checked_graph_state(self._graph, batch_size)
        # The host numbers are frozen in a captured graph: the longest context the pool allows, whatever the batch.
        return _Metadata(
            block_table=graph.block_table[:batch_size],
            cu_seqlens_q=graph.cu_seqlens_q[: batch_size + 1],
            cu_seqlens_kv=graph.cu_seqlens_kv[: batch_size + 1],
            context_lens=graph.context_lens[:batch_size],
            max_seqlen_q=1,
            max_seqlen_kv=self.context.max_context_len,
        )

    def init_forward_metadata_capture(self, batch: ForwardBatch) -> None:
        self._meta = self._graph_metadata(batch.batch_size)
        self._fill_graph(batch.req_pool_indices, batch.seq_lens_cpu, batch.batch_size)

    def init_forward_metadata_replay(self, batch: ForwardBatch, padded_batch_size: int) -> None:
        self._meta = self._graph_metadata(padded_batch_size)
        batch_size = batch.batch_size
        if batch_size > padded_batch_size:
            raise ValueError(f"batch of {batch_size} requests replayed in a graph of {padded_batch_size}")
        pad = padded_batch_size - batch_size
        # Padding rows read one key of request row 0, as the graph runner pads; their output is discarded.
        rows = torch.cat([batch.req_pool_indices, batch.req_pool_indices.new_zeros(pad)])
        seq_lens = torch.cat([batch.seq_lens_cpu, batch.seq_lens_cpu.new_ones(pad)])
        self._fill_graph(rows, seq_lens, padded_batch_size)

    def _fill_graph(self, rows: torch.Tensor, seq_lens_cpu: torch.Tensor, batch_size: int) -> None:
        graph = self._graph
        lens = seq_lens_cpu.to(torch.int32)
        host = torch.zeros(2, batch_size + 1, dtype=torch.int32)
        torch.cumsum(lens, 0, out=host[0, 1:])
        host[1, :-1] = lens
        on_device = host.to(self.context.device, non_blocking=True)
        graph.cu_seqlens_kv[: batch_size + 1].copy_(on_device[0])
        graph.context_lens[:batch_size].copy_(on_device[1, :-1])
        graph.block_table[:batch_size].copy_(self._block_table(rows, graph.block_table.shape[1]))


def build_ipex_attention(build: Build) -> Any:
    """A backend factory (context -> IpexAttention) for one IPEX build."""

    def factory(context: AttentionContext) -> IpexAttention:
        return IpexAttention(context, build)

    return factory
