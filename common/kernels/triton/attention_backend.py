"""The portable Triton attention backend: paged decode (split-K) and extend kernels, graph-capturable decode.

Importing this module imports triton, so the registry imports it only when the backend is built. Per-batch
metadata is computed once in `init_forward_metadata` (no device-to-host sync: host numbers come from the batch's
`*_cpu` copies) and shared by every layer. For graphs, the decode metadata lives in static buffers that a replay
refreshes in place; padding rows of a padded batch read request row 0 with one key and their output is ignored.
"""

from __future__ import annotations

import dataclasses

import torch

from omnirun.attention.backend import AttentionBackend, AttentionContext, AttentionLayerSpec, Rotary
from omnirun.batch import ForwardBatch, ForwardMode
from omnirun.kernels.triton import kv_store as triton_kv_store
from omnirun.kernels.triton.decode import decode_attention, partial_buffers
from omnirun.kernels.triton.extend import extend_attention


@dataclasses.dataclass
class _DecodeMetadata:
    req_rows: torch.Tensor  # [batch] int64: each request's row of the request-to-token table
    seq_lens: torch.Tensor  # [batch] int32: keys per request, its new token included
    part_out: torch.Tensor  # [batch, heads, splits, head_dim] float32 scratch of the split stage
    part_lse: torch.Tensor  # [batch, heads, splits] float32 scratch of the split stage


@dataclasses.dataclass
class _ExtendMetadata:
    req_rows: torch.Tensor  # [batch] int64
    q_starts: torch.Tensor  # [batch] int32: first new token of each request in q
    extend_lens: torch.Tensor  # [batch] int32: new tokens per request
    prefix_lens: torch.Tensor  # [batch] int32: tokens cached before this step
    max_extend_len: int  # host int: sizes the grid


@dataclasses.dataclass
class _GraphBuffers:
    """Static decode scratch for captured graphs, sized for the largest captured batch."""

    part_out: torch.Tensor
    part_lse: torch.Tensor

    @property
    def max_batch_size(self) -> int:
        return self.part_out.shape[0]


class TritonAttention(AttentionBackend):
    """Attention over the paged KV cache with Triton kernels; runs wherever the capabilities say triton.

    num_splits: how many parts decode splits each request's keys into at most (fixed per batch size, so a captured
    graph serves every sequence length); more splits keep the GPU busy at small batch sizes, fewer waste less on
    short sequences. A batch with `DECODE_PROGRAMS` (request, KV head) pairs or more fills the GPU by itself and
    takes fewer splits (one at the largest batches, which then skips the merge and its scratch traffic).
    The rotary embedding a layer hands over is fused into the KV store where the kernel takes its inputs.
    The remaining arguments tune the kernels' launches (None: the tiles `extend.extend_tiles` picks); `pdl`
    launches the decode-path kernels with programmatic dependent launch (`omnirun.kernels.triton.pdl`).
    """

    name = "triton"
    supports_graph = True
    # Deterministic mode: one decode split (each request's keys in one pass from position 0, whatever the batch
    # size) and the extend kernel's aligned walk (chunking and cached prefixes do not move block boundaries).
    batch_invariant = True
    # (request, KV head, split) programs enough to keep a large GPU busy: about two per SM of an H200's 132. Swept
    # there (bench/decode_tuning.py, bench/results/h200_decode_tuning.json), 32 requests of 8 KV heads ran fastest
    # in one split at 192-2,048 tokens (13.3 against 18.0 us a layer with 4 splits at 192), and one request in 16.
    DECODE_PROGRAMS = 256

    def __init__(
        self,
        context: AttentionContext,
        num_splits: int = 16,
        *,
        decode_block_n: int = 64,
        decode_num_warps: int = 4,
        decode_num_stages: int = 2,
        extend_block_m: int | None = None,
        extend_block_n: int | None = None,
        pdl: bool = False,
    ):
        super().__init__(context)
        if num_splits < 1:
            raise ValueError(f"num_splits must be >= 1, got {num_splits}")
        self.num_splits = 1 if context.deterministic else num_splits
        self.pdl = pdl
        self._decode_launch = dict(
            block_n=decode_block_n, num_warps=decode_num_warps, num_stages=decode_num_stages, pdl=pdl
        )
        self._extend_launch = {"block_m": extend_block_m, "block_n": extend_block_n, "aligned": context.deterministic}
        self._decode: _DecodeMetadata | None = None
        self._extend: _ExtendMetadata | None = None
        self._graph: _GraphBuffers | None = None
        self._captured: dict[int, _DecodeMetadata] = {}  # each captured batch size's metadata
        # Eager decode scratch, grown to the largest batch seen and shared by every layer and step.
        self._scratch: tuple[torch.Tensor, torch.Tensor] | None = None

    # --- metadata ---
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        if batch.mode is ForwardMode.DECODE:
            part_out, part_lse = self._eager_scratch(batch.batch_size)
            splits = self.decode_splits(batch.batch_size)
            self._decode = _DecodeMetadata(
                batch.req_pool_indices, batch.seq_lens, part_out[:, :, :splits], part_lse[:, :, :splits]
            )
            return
        extend_lens = batch.extend_seq_lens_cpu.to(torch.int32)
        q_starts = torch.cumsum(extend_lens, 0, dtype=torch.int32) - extend_lens
        host = torch.stack([q_starts, extend_lens, batch.extend_prefix_lens_cpu.to(torch.int32)])
        device_ints = host.to(batch.req_pool_indices.device, non_blocking=True)  # one copy for all three
        max_extend_len = int(extend_lens.max()) if extend_lens.numel() else 0
        self._extend = _ExtendMetadata(
            batch.req_pool_indices, device_ints[0], device_ints[1], device_ints[2], max_extend_len
        )

    def decode_splits(self, batch_size: int) -> int:
        """The split count of a decode batch of `batch_size` requests: `num_splits`, fewer once the batch alone
        makes `DECODE_PROGRAMS` programs. Below `num_splits` it is a power of two: each count is a kernel variant
        to compile, and the graphs of 35 batch sizes would otherwise ask for a dozen of them."""
        pairs = max(batch_size, 1) * self.context.num_kv_heads
        wanted = -(-self.DECODE_PROGRAMS // pairs)
        return min(self.num_splits, 1 << (wanted - 1).bit_length())  # the power of two at or above

    def _eager_scratch(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._scratch is None or self._scratch[0].shape[0] < batch_size:
            # Powers of two: a growing batch reallocates a handful of times, not on every new size.
            size = 1 << max(batch_size - 1, 0).bit_length()
            ctx = self.context
            self._scratch = partial_buffers(size, ctx.num_heads, self.num_splits, ctx.head_dim, ctx.device)
        part_out, part_lse = self._scratch
        return part_out[:batch_size], part_lse[:batch_size]

    # --- forward ---
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayerSpec,
        batch: ForwardBatch,
        rotary: Rotary | None = None,
    ) -> torch.Tensor:
        k_cache, v_cache = self.context.kv.kv_cache.get_kv(layer.layer_id)
        fused = rotary is not None and triton_kv_store.fuses_rotary(
            k_cache, rotary.positions, q, k, v, rotary.cos_sin_cache, rotary.head_dim
        )
        if not fused:
            return super().forward(q, k, v, layer, batch, rotary)
        # One launch rotates q in place and writes the rotated k and v to the cache (the kernels read k there).
        triton_kv_store.rotate_and_store_kv(
            k_cache,
            v_cache,
            batch.out_cache_loc,
            rotary.positions,
            q,
            k,
            v,
            rotary.cos_sin_cache,
            rotary.head_dim,
            scales=self.context.kv.kv_cache.scales(layer.layer_id),
            pdl=self.pdl,
        )
        if batch.mode is ForwardMode.DECODE:
            return self._decode_attention(q, layer, batch)
        return self._extend_attention(q, layer, batch)

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch) -> None:
        k_cache, v_cache = self.context.kv.kv_cache.get_kv(layer.layer_id)
        if not triton_kv_store.supports(k_cache.dtype, k.dtype):  # e.g. fnuz fp8: torch's cast
            return super().store_kv(k, v, layer, batch)
        # One launch for K and V, reading strided rows of the qkv output in place.
        scales = self.context.kv.kv_cache.scales(layer.layer_id)
        triton_kv_store.store_kv(k_cache, v_cache, batch.out_cache_loc, k, v, scales=scales, pdl=self.pdl)

    def forward_extend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch
    ) -> torch.Tensor:
        self.store_kv(k, v, layer, batch)
        return self._extend_attention(q, layer, batch)

    def _extend_attention(self, q: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch) -> torch.Tensor:
        k_cache, v_cache = self.context.kv.kv_cache.get_kv(layer.layer_id)
        meta = self._extend
        out = q.new_empty((q.shape[0], layer.num_heads * layer.head_dim))
        extend_attention(
            q.view(-1, layer.num_heads, layer.head_dim),
            k_cache,
            v_cache,
            out.view(-1, layer.num_heads, layer.head_dim),
            self.context.kv.req_to_token.table,
            meta.req_rows,
            meta.q_starts,
            meta.extend_lens,
            meta.prefix_lens,
            meta.max_extend_len,
            layer.scaling,
            layer.sliding_window,
            **self._extend_launch,
        )
        return out

    def forward_decode(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch
    ) -> torch.Tensor:
        self.store_kv(k, v, layer, batch)
        return self._decode_attention(q, layer, batch)

    def _decode_attention(self, q: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch) -> torch.Tensor:
        k_cache, v_cache = self.context.kv.kv_cache.get_kv(layer.layer_id)
        meta = self._decode
        batch_size = q.shape[0]
        part_out, part_lse = meta.part_out, meta.part_lse
        if part_out.shape[1] != layer.num_heads or part_out.shape[3] != layer.head_dim:
            # A layer shaped unlike the context (never in the models we run): scratch of its own, eager only.
            splits = self.decode_splits(batch_size)
            part_out, part_lse = partial_buffers(batch_size, layer.num_heads, splits, layer.head_dim, q.device)
        out = q.new_empty((batch_size, layer.num_heads * layer.head_dim))
        decode_attention(
            q.view(batch_size, layer.num_heads, layer.head_dim),
            k_cache,
            v_cache,
            self.context.kv.req_to_token.table,
            meta.req_rows,
            meta.seq_lens,
            part_out,
            part_lse,
            out.view(batch_size, layer.num_heads, layer.head_dim),
            layer.scaling,
            layer.sliding_window,
            **self._decode_launch,
        )
        return out

    # --- graph hooks ---
    def init_graph_state(self, max_batch_size: int) -> None:
        ctx = self.context
        part_out, part_lse = partial_buffers(max_batch_size, ctx.num_heads, self.num_splits, ctx.head_dim, ctx.device)
        self._graph = _GraphBuffers(part_out=part_out, part_lse=part_lse)
        self._captured = {}

    def init_forward_metadata_capture(self, batch: ForwardBatch) -> None:
        # The kernels read the static batch's rows and lengths, which the graph runner refills and pads before
        # every replay: a replay copies nothing.
        size, splits = batch.batch_size, self.decode_splits(batch.batch_size)
        graph = self._graph_buffers(size)
        self._decode = _DecodeMetadata(
            batch.req_pool_indices, batch.seq_lens, graph.part_out[:size, :, :splits], graph.part_lse[:size, :, :splits]
        )
        self._captured[size] = self._decode

    def init_forward_metadata_replay(self, batch: ForwardBatch, padded_batch_size: int) -> None:
        if batch.batch_size > padded_batch_size:
            raise ValueError(f"batch of {batch.batch_size} requests replayed in a graph of {padded_batch_size}")
        if padded_batch_size not in self._captured:
            raise ValueError(f"no graph of batch size {padded_batch_size} was captured")
        self._decode = self._captured[padded_batch_size]

    def _graph_buffers(self, batch_size: int) -> _GraphBuffers:
        return self._checked_graph_state(self._graph, batch_size)
