"""Attention over the paged KV cache with torch's scaled_dot_product_attention: runs on every device.

It gathers each request's K/V from the pool through the request-to-token table. EXTEND runs request by request
(each has its own prefix and length); DECODE gathers the whole batch, padded to its longest sequence, and runs one
masked call per layer. It is the reference every other backend is checked against.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from omnirun.attention.backend import AttentionBackend, AttentionLayerSpec
from omnirun.batch import ForwardBatch, ForwardMode

# Every SDPA implementation but cuDNN's: it builds an execution plan for each new shape (milliseconds each), and
# the shapes here change every step (prefix lengths, the longest sequence of a decode batch).
_SDPA_BACKENDS = [
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.OVERRIDEABLE,  # PrivateUse1 devices register their fused attention here
    SDPBackend.MATH,
]


@dataclasses.dataclass
class _ExtendRequest:
    token_start: int  # first of its new tokens in the batch
    prefix_len: int
    extend_len: int
    slots: torch.Tensor  # [prefix_len + extend_len] KV slots, in position order


@dataclasses.dataclass
class _DecodeMetadata:
    slots: torch.Tensor  # [batch, max_len] KV slots; padding points at slot 0 (zeroed, never NaN)
    key_positions: torch.Tensor  # [max_len]
    last_positions: torch.Tensor  # [batch, 1]: the position of each request's query
    masks: dict[int | None, torch.Tensor]  # per sliding window: [batch, 1, 1, max_len] bool, True = attend


class TorchNativeAttention(AttentionBackend):
    name = "torch_native"

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        table = self.context.kv.req_to_token.table
        if batch.mode is ForwardMode.DECODE:
            max_len = int(batch.seq_lens_cpu.max())
            key_positions = torch.arange(max_len, device=batch.seq_lens.device)
            valid = key_positions[None, :] < batch.seq_lens[:, None]
            slots = torch.where(valid, table[batch.req_pool_indices, :max_len], 0).long()
            last = (batch.seq_lens - 1).long()[:, None]
            self._decode = _DecodeMetadata(slots, key_positions, last, {None: valid[:, None, None, :]})
            return
        self._extend = []
        token_start = 0
        rows = batch.req_pool_indices.tolist() if batch.batch_size else []
        lens = zip(batch.extend_prefix_lens_cpu.tolist(), batch.extend_seq_lens_cpu.tolist(), strict=True)
        for row, (prefix_len, extend_len) in zip(rows, lens, strict=True):
            slots = table[row, : prefix_len + extend_len].long()
            self._extend.append(_ExtendRequest(token_start, prefix_len, extend_len, slots))
            token_start += extend_len

    def forward_extend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch
    ) -> torch.Tensor:
        self.store_kv(k, v, layer, batch)
        k_cache, v_cache = self.context.kv.kv_cache.get_kv(layer.layer_id)
        out = torch.empty_like(q)
        for req in self._extend:
            tokens = slice(req.token_start, req.token_start + req.extend_len)
            q_req = q[tokens].view(req.extend_len, layer.num_heads, layer.head_dim).transpose(0, 1)
            k_req = k_cache[req.slots].to(q.dtype).transpose(0, 1)
            v_req = v_cache[req.slots].to(q.dtype).transpose(0, 1)
            mask = _extend_mask(req, layer.sliding_window, q.device)
            with sdpa_kernel(_SDPA_BACKENDS):
                o = F.scaled_dot_product_attention(
                    q_req, k_req, v_req, attn_mask=mask, is_causal=mask is None, scale=layer.scaling, enable_gqa=True
                )
            out[tokens] = o.transpose(0, 1).reshape(req.extend_len, -1)
        return out

    def forward_decode(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch
    ) -> torch.Tensor:
        self.store_kv(k, v, layer, batch)
        k_cache, v_cache = self.context.kv.kv_cache.get_kv(layer.layer_id)
        meta = self._decode
        # One query per request: plain batched matmuls, the query heads grouped under their KV head (GQA), beat
        # SDPA's kernels here (several times faster on CPU) and keep the scores in float32 for the softmax.
        batch_size, group = q.shape[0], layer.num_heads // layer.num_kv_heads
        q_b = q.view(batch_size, layer.num_kv_heads, group, layer.head_dim)
        k_b = k_cache[meta.slots].to(q.dtype).permute(0, 2, 3, 1)  # [batch, kv_heads, head_dim, max_len]
        v_b = v_cache[meta.slots].to(q.dtype).transpose(1, 2)  # [batch, kv_heads, max_len, head_dim]
        scores = torch.matmul(q_b, k_b).float() * layer.scaling
        scores = scores.masked_fill(~self._decode_mask(layer.sliding_window), float("-inf"))
        o = torch.matmul(scores.softmax(dim=-1).to(q.dtype), v_b)
        return o.reshape(batch_size, -1)

    def _decode_mask(self, window: int | None) -> torch.Tensor:
        meta = self._decode
        if window not in meta.masks:
            in_window = meta.key_positions[None, :] > meta.last_positions - window
            meta.masks[window] = meta.masks[None] & in_window[:, None, None, :]
        return meta.masks[window]


def _extend_mask(req: _ExtendRequest, window: int | None, device: torch.device) -> torch.Tensor | None:
    """[extend_len, prefix_len + extend_len] bool (True = attend), or None for the plain causal case."""
    if req.prefix_len == 0 and window is None:
        return None
    query_positions = torch.arange(req.prefix_len, req.prefix_len + req.extend_len, device=device)[:, None]
    key_positions = torch.arange(req.prefix_len + req.extend_len, device=device)[None, :]
    mask = key_positions <= query_positions
    if window is not None:
        mask &= key_positions > query_positions - window
    return mask
