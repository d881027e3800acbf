"""Batch-invariant attention in plain torch: each query's result depends on its own keys alone, never on the batch.

What deterministic mode needs of attention (SGLang's --enable-deterministic-inference, vLLM's batch-invariant
mode): a query at position p gives the same bits whether it is decoded alone or beside 255 others, prefilled with
its whole prompt or in 16-token chunks, or after its prefix came from the cache. So the arithmetic of one query
must be fixed by p alone:

- keys are cut into blocks of `BLOCK` positions counted from position 0 (never from a chunk's or batch's start);
- a score is an elementwise product summed over head_dim, a block's sums run over exactly `BLOCK` entries, and
  blocks are folded left to right; keys past p (or outside the window) are masked to probability 0, which adds
  exact zeros, so the blocks a longer neighbour needs change nothing;
- the softmax is taken in two passes (its maximum is exact in any order), all in float32.

No matmul appears: a GEMM's reduction order may change with the number of rows (torch's float32 CPU matmul takes
another kernel below ~8 rows). The same function serves prefill and decode, so a position computed either way
gives the same bits. It is slow for long contexts and cannot be captured in a graph; devices with a capturable
batch-invariant kernel (the Triton backend) offer that instead.
"""

from __future__ import annotations

import dataclasses

import torch

from omnirun.attention.backend import AttentionBackend, AttentionLayerSpec
from omnirun.batch import ForwardBatch, ForwardMode

# Key positions per block, and queries per tile: the tile bounds memory, it does not change a query's arithmetic.
BLOCK = 64
QUERY_TILE = 64


@dataclasses.dataclass
class _Queries:
    """Queries that share one row of the request-to-token table (EXTEND: one request's new tokens), or one query
    per request (DECODE)."""

    token_start: int  # first of these queries' tokens in the batch
    positions: torch.Tensor  # [n] int64: each query's position (it sees keys 0..position)
    slots: torch.Tensor  # [1 or n, keys] int64 KV slots in position order; past a request's length: slot 0
    # Host ints: EXTEND's first position (its queries are consecutive), None for DECODE; the last position seen.
    first_position: int | None
    last_position: int

    def last_position_of(self, tile: slice) -> int:
        if self.first_position is None:
            return self.last_position
        return self.first_position + tile.stop - 1


class BatchInvariantAttention(AttentionBackend):
    name = "batch_invariant"
    batch_invariant = True

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        table = self.context.kv.req_to_token.table
        if batch.mode is ForwardMode.DECODE:
            max_len = int(batch.seq_lens_cpu.max())
            keys = torch.arange(max_len, device=batch.seq_lens.device)
            valid = keys[None, :] < batch.seq_lens[:, None]
            # Padding points at slot 0 (zeroed, never NaN): a masked key then adds 0 * finite = 0.
            slots = torch.where(valid, table[batch.req_pool_indices, :max_len], 0).long()
            self._groups = [_Queries(0, (batch.seq_lens - 1).long(), slots, None, max_len - 1)]
            return
        self._groups = []
        token_start = 0
        rows = batch.req_pool_indices.tolist() if batch.batch_size else []
        lens = zip(batch.extend_prefix_lens_cpu.tolist(), batch.extend_seq_lens_cpu.tolist(), strict=True)
        for row, (prefix_len, extend_len) in zip(rows, lens, strict=True):
            end = prefix_len + extend_len
            positions = torch.arange(prefix_len, end, device=table.device)
            self._groups.append(_Queries(token_start, positions, table[row, :end].long()[None], prefix_len, end - 1))
            token_start += extend_len

    def forward_extend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch
    ) -> torch.Tensor:
        self.store_kv(k, v, layer, batch)
        return self._attend(q, layer)

    def forward_decode(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch
    ) -> torch.Tensor:
        self.store_kv(k, v, layer, batch)
        return self._attend(q, layer)

    def _attend(self, q: torch.Tensor, layer: AttentionLayerSpec) -> torch.Tensor:
        k_cache, v_cache = self.context.kv.kv_cache.get_kv(layer.layer_id)
        out = torch.empty_like(q)
        group = layer.num_heads // layer.num_kv_heads
        for queries in self._groups:
            n = queries.positions.shape[0]
            for start in range(0, n, QUERY_TILE):
                tile = slice(start, min(start + QUERY_TILE, n))
                tokens = slice(queries.token_start + tile.start, queries.token_start + tile.stop)
                q_tile = q[tokens].view(-1, layer.num_kv_heads, group, layer.head_dim).float()
                slots = queries.slots if queries.slots.shape[0] == 1 else queries.slots[tile]
                num_keys = queries.last_position_of(tile) + 1
                o = _attend_tile(q_tile, queries.positions[tile], slots, num_keys, k_cache, v_cache, layer, q.dtype)
                out[tokens] = o.reshape(o.shape[0], -1).to(q.dtype)
        return out


def _attend_tile(
    q: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    num_keys: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    layer: AttentionLayerSpec,
    dtype: torch.dtype,
) -> torch.Tensor:
    """q [t, kv_heads, group, head_dim] float32 at `positions` [t] over keys 0..num_keys-1 at `slots` [1 or t,
    >= num_keys] -> [t, kv_heads, group, head_dim] float32."""
    scores, values = [], []
    for lo in range(0, num_keys, BLOCK):
        block = slots[:, lo : min(lo + BLOCK, num_keys)]
        if block.shape[1] < BLOCK:  # the last block: padded with slot 0 up to BLOCK keys, masked below
            block = torch.nn.functional.pad(block, (0, BLOCK - block.shape[1]))
        # Cache -> model dtype -> float32, as the reference casts the cache to q's dtype (exact for fp8).
        keys = k_cache[block].to(dtype).float().permute(0, 2, 1, 3)[:, :, None]  # [1|t, kv_heads, 1, BLOCK, D]
        values.append(v_cache[block].to(dtype).float().permute(0, 2, 3, 1)[:, :, None])  # [.., 1, D, BLOCK]
        s = (q[:, :, :, None, :] * keys).sum(-1) * layer.scaling  # [t, kv_heads, group, BLOCK]
        key_positions = torch.arange(lo, lo + BLOCK, device=q.device)
        seen = key_positions[None, :] <= positions[:, None]
        if layer.sliding_window is not None:
            seen &= key_positions[None, :] > positions[:, None] - layer.sliding_window
        scores.append(s.masked_fill(~seen[:, None, None, :], float("-inf")))
    every = torch.stack(scores, dim=3)  # [t, kv_heads, group, blocks, BLOCK]
    probs = torch.exp(every - every.amax(dim=(3, 4), keepdim=True))  # the maximum is exact in any order
    total = torch.zeros(q.shape[:3], dtype=torch.float32, device=q.device)
    out = torch.zeros_like(q)
    for j, value in enumerate(values):  # folded left to right: extra masked blocks add exact zeros
        p = probs[:, :, :, j]
        total = total + p.sum(-1)
        out = out + (p[:, :, :, None, :] * value).sum(-1)
    return out / total[..., None]
