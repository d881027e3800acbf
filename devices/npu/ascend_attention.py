"""The ascend attention backend: torch_npu's ATB paged-KV operators over omnirun's KV pool, graph-capturable decode.

torch_npu is imported when the backend is built, never at `import omnirun`. The calls follow SGLang's NPU backend
(sgl-project/sglang:python/sglang/srt/hardware_backend/npu/attention/ascend_backend.py, memory_pool_npu.py) and
vllm-ascend v0.11.0 (vllm-project/vllm-ascend:vllm_ascend/attention/attention_v1.py); the schemas are those of
Ascend/op-plugin:op_plugin/ops/atb/{ReshapeAndCachAtb,PagedAttentionAtb,SelfAttentionQlensAtb}.cpp.

Layout: our pool keeps one [slots, kv_heads, head_dim] buffer per layer for K and one for V, and a request's
position p lives in slot page * page_size + p % page_size. The first whole pages of a buffer, viewed as
[pages, page_size, kv_heads, head_dim], are the ATB "BSND" paged cache, without a copy (SGLang's NPU pool allocates
exactly that shape). A request's block table row lists its pages: req_to_token[row, ::page_size] // page_size.

The ATB operators take no sliding window: layers with one run plain torch over the same block table (decode, with
device-side lengths, so it is captured too) or torch_native's math (extend). Only bf16/fp16 caches in the model
dtype: the ATB kernels read nothing else.
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
from omnirun.attention.torch_native import TorchNativeAttention
from omnirun.batch import ForwardBatch, ForwardMode
from omnirun.devices.npu.npu_graphs import note_host_input
from omnirun.errors import ConfigError

# SGLang's ATB prefill mask: 128 x 128, upper triangle masked (finfo(float32).min for fp16, 1 for bf16), model
# dtype (ascend_backend.py::AscendAttnMaskBuilder.generate_attn_mask, "norm"); the operator reads it compressed.
MASK_LEN = 128


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def prefill_mask(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    upper = torch.ones(MASK_LEN, MASK_LEN, dtype=torch.bool).triu_(1)
    value = torch.finfo(torch.float32).min if dtype == torch.float16 else 1.0
    return torch.zeros(MASK_LEN, MASK_LEN).masked_fill_(upper, value).to(device, dtype)


def block_table(req_to_token: torch.Tensor, rows: torch.Tensor, page_size: int, pages: int) -> torch.Tensor:
    """[len(rows), pages] int32: the page of each request's j-th page, gathered on the device."""
    first_slots = req_to_token[rows.to(req_to_token.device)][:, ::page_size][:, :pages]
    return torch.div(first_slots, page_size, rounding_mode="floor").to(torch.int32)


@dataclasses.dataclass
class _Decode:
    block_table: torch.Tensor  # [batch, pages] int32 on the device
    context_lens: torch.Tensor  # [batch] int32 on the host (ATB reads it when launched)
    seq_lens: torch.Tensor  # [batch] int32 on the device (the windowed path reads it)


@dataclasses.dataclass
class _Extend:
    block_table: torch.Tensor
    seq_len: torch.Tensor  # [batch] int32 host: new tokens per request
    context_lens: torch.Tensor  # [batch] int32 host: cached + new tokens per request


@dataclasses.dataclass
class _GraphBuffers:
    block_table: torch.Tensor  # [max_batch, max_pages] int32, device
    context_lens: torch.Tensor  # [max_batch] int32, host
    seq_lens: torch.Tensor  # [max_batch] int32, device

    @property
    def max_batch_size(self) -> int:
        return self.context_lens.shape[0]


class AscendAttention(AttentionBackend):
    name = "ascend"
    supports_graph = True

    def __init__(self, context: AttentionContext):
        super().__init__(context)
        import torch_npu  # the vendor import, only once this backend is chosen

        self._npu = torch_npu
        kv_dtype = context.kv.kv_cache.dtype
        require_half_precision(context, self.name)
        if kv_dtype != context.model_dtype:
            raise ConfigError(
                f"the ascend attention backend reads a KV cache in the model dtype, not {_dtype_name(kv_dtype)}: "
                "pass --kv-cache-dtype auto, or choose --attention-backend torch_native"
            )
        require_grouped_heads(context)
        self.page_size = context.kv.page_size
        self._pages = -(-context.kv.req_to_token.table.shape[1] // self.page_size)  # block table width
        self._mask = prefill_mask(context.model_dtype, context.device)
        self._native = TorchNativeAttention(context)  # sliding-window extend
        self._decode: _Decode | None = None
        self._extend: _Extend | None = None
        self._graph: _GraphBuffers | None = None

    # --- layout ---
    def _paged(self, layer: AttentionLayerSpec) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's K and V as [pages, page_size, kv_heads, head_dim] views (whole pages only, no copy)."""
        k, v = self.context.kv.kv_cache.get_kv(layer.layer_id)
        whole = (k.shape[0] // self.page_size) * self.page_size
        shape = (-1, self.page_size, layer.num_kv_heads, layer.head_dim)
        return k[:whole].view(shape), v[:whole].view(shape)

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch) -> None:
        k_cache, v_cache = self._paged(layer)
        heads = (-1, layer.num_kv_heads, layer.head_dim)
        # Ascend/op-plugin ReshapeAndCachAtb.cpp: _npu_reshape_and_cache(key, value, key_cache, value_cache,
        # slot_indices) writes in place, slots int32 = page * page_size + offset; SGLang memory_pool_npu.py
        # NPUMHATokenToKVPool.set_kv_buffer calls it with loc.to(torch.int32) and the [-1, page, H, D] views.
        self._npu._npu_reshape_and_cache(
            k.to(k_cache.dtype).contiguous().view(heads),
            v.to(v_cache.dtype).contiguous().view(heads),
            k_cache,
            v_cache,
            batch.out_cache_loc.to(torch.int32),
        )

    # --- metadata ---
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        table = self.context.kv.req_to_token.table
        if batch.mode is ForwardMode.DECODE:
            self._decode = _Decode(
                block_table(table, batch.req_pool_indices, self.page_size, self._pages),
                batch.seq_lens_cpu.to(torch.int32),
                batch.seq_lens.to(torch.int32),
            )
            return
        self._extend = _Extend(
            block_table(table, batch.req_pool_indices, self.page_size, self._pages),
            batch.extend_seq_lens_cpu.to(torch.int32),
            batch.seq_lens_cpu.to(torch.int32),
        )
        self._native.init_forward_metadata(batch)

    # --- forward ---
    def forward_extend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch
    ) -> torch.Tensor:
        self.store_kv(k, v, layer, batch)
        if layer.sliding_window is not None:
            return self._native_extend(q, layer, batch)
        step = self._extend
        k_cache, v_cache = self._paged(layer)
        out = q.new_empty((q.shape[0], layer.num_heads * layer.head_dim))
        # op-plugin SelfAttentionQlensAtb.cpp: _npu_flash_attention_qlens(query, key_cache, value_cache,
        # block_table, mask, seq_len, context_lens, num_kv_heads, num_heads, scale_value, out), called as SGLang's
        # ascend_backend.py::forward_extend does: query/out [T, Hq*D], host int32 query and total lengths, the new
        # tokens of each request causal from the bottom right over its cached prefix.
        self._npu._npu_flash_attention_qlens(
            q.contiguous().view(q.shape[0], -1),
            k_cache,
            v_cache,
            step.block_table,
            self._mask,
            step.seq_len,
            step.context_lens,
            layer.num_kv_heads,
            layer.num_heads,
            layer.scaling,
            out,
        )
        return out

    def _native_extend(self, q: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch) -> torch.Tensor:
        # K/V are stored already; torch_native's own store writes the same values again, which is harmless.
        empty = q.new_empty((q.shape[0], layer.num_kv_heads * layer.head_dim))
        native = self._native
        saved, native.store_kv = native.store_kv, lambda *args: None
        try:
            return native.forward_extend(q, empty, empty, layer, batch)
        finally:
            native.store_kv = saved

    def forward_decode(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch
    ) -> torch.Tensor:
        self.store_kv(k, v, layer, batch)
        step = self._decode
        if layer.sliding_window is not None:
            return self._window_decode(q, layer, step)
        k_cache, v_cache = self._paged(layer)
        batch_size = q.shape[0]
        heads = (batch_size, layer.num_heads, layer.head_dim)
        out = q.new_empty(heads)
        note_host_input("context_lens", step.context_lens)  # rewritten before each replay of a captured graph
        # op-plugin PagedAttentionAtb.cpp: _npu_paged_attention(query, key_cache, value_cache, num_kv_heads,
        # num_heads, scale_value, block_table, context_lens, out, *, workspace=None), called as SGLang's
        # ascend_backend.py::forward_decode_graph and vllm-ascend v0.11.0 attention_v1.py::_forward_decode_only do:
        # query/out [B, Hq, D], BSND caches, int32 block table on the device, int32 context lengths on the host.
        self._npu._npu_paged_attention(
            q.contiguous().view(heads),
            k_cache,
            v_cache,
            layer.num_kv_heads,
            layer.num_heads,
            layer.scaling,
            step.block_table,
            step.context_lens,
            out,
        )
        return out.view(batch_size, -1)

    def _window_decode(self, q: torch.Tensor, layer: AttentionLayerSpec, step: _Decode) -> torch.Tensor:
        """Plain torch over the block table with device-side lengths: nothing read on the host, so it captures."""
        k_cache, v_cache = self._paged(layer)
        ps = self.page_size
        batch_size, group = q.shape[0], layer.num_heads // layer.num_kv_heads
        pages = step.block_table.long()  # [batch, pages]
        keys = pages.shape[1] * ps
        position = torch.arange(keys, device=q.device)
        slots = (pages[:, :, None] * ps + torch.arange(ps, device=q.device)).view(batch_size, keys)
        lens = step.seq_lens.long()[:, None]
        valid = (position[None, :] < lens) & (position[None, :] >= lens - layer.sliding_window)
        flat = (-1, layer.num_kv_heads, layer.head_dim)
        k_b = k_cache.view(flat)[slots].permute(0, 2, 3, 1)  # [batch, kv_heads, head_dim, keys]
        v_b = v_cache.view(flat)[slots].transpose(1, 2)  # [batch, kv_heads, keys, head_dim]
        q_b = q.view(batch_size, layer.num_kv_heads, group, layer.head_dim)
        scores = torch.matmul(q_b, k_b).float() * layer.scaling
        scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
        o = torch.matmul(scores.softmax(dim=-1).to(q.dtype), v_b)
        return o.reshape(batch_size, -1)

    # --- graph hooks ---
    def init_graph_state(self, max_batch_size: int) -> None:
        device = self.context.device
        self._graph = _GraphBuffers(
            torch.zeros(max_batch_size, self._pages, dtype=torch.int32, device=device),
            torch.ones(max_batch_size, dtype=torch.int32),
            torch.ones(max_batch_size, dtype=torch.int32, device=device),
        )

    def _graph_step(self, rows: torch.Tensor, seq_lens_cpu: torch.Tensor) -> None:
        graph = self._checked_graph_state(self._graph, rows.shape[0])
        bs = rows.shape[0]
        # In place: the memory the captured graphs read (the host lengths reach them through NPUGraph.update).
        graph.block_table[:bs].copy_(block_table(self.context.kv.req_to_token.table, rows, self.page_size, self._pages))
        graph.context_lens[:bs].copy_(seq_lens_cpu)
        graph.seq_lens[:bs].copy_(seq_lens_cpu, non_blocking=True)
        self._decode = _Decode(graph.block_table[:bs], graph.context_lens[:bs], graph.seq_lens[:bs])

    def init_forward_metadata_capture(self, batch: ForwardBatch) -> None:
        self._graph_step(batch.req_pool_indices, batch.seq_lens_cpu)

    def init_forward_metadata_replay(self, batch: ForwardBatch, padded_batch_size: int) -> None:
        self._checked_graph_state(self._graph, padded_batch_size)
        if batch.batch_size > padded_batch_size:
            raise ValueError(f"batch of {batch.batch_size} requests replayed in a graph of {padded_batch_size}")
        pad = padded_batch_size - batch.batch_size
        # Padding rows read one key of request row 0, as the graph runner pads; their output is discarded.
        rows = torch.cat([batch.req_pool_indices, batch.req_pool_indices.new_zeros(pad)])
        seq_lens_cpu = torch.cat([batch.seq_lens_cpu, batch.seq_lens_cpu.new_ones(pad)])
        self._graph_step(rows, seq_lens_cpu)
