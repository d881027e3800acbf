"""The attention layer as the model sees it: hands q/k/v to the batch's attention backend."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from omnirun.attention.backend import AttentionBackend, AttentionLayerSpec, Rotary
from omnirun.batch import ForwardBatch


class PagedAttention(nn.Module):
    def __init__(self, spec: AttentionLayerSpec):
        super().__init__()
        self.spec = spec

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        batch: ForwardBatch,
        backend: AttentionBackend,
        rotary: Rotary | None = None,
    ) -> torch.Tensor:
        # An fp8 cache holds K / k_scale and V / v_scale: softmax(s q.K^T) V = softmax(s k_scale q.K'^T) V' v_scale
        # for the stored K', V', so every backend applies the scales through the softmax scale it already takes.
        k_scale, v_scale = backend.context.kv.kv_cache.scales(self.spec.layer_id)
        spec = self.spec if k_scale == 1.0 else dataclasses.replace(self.spec, scaling=self.spec.scaling * k_scale)
        out = backend.forward(q, k, v, spec, batch, rotary)
        return out if v_scale == 1.0 else out * v_scale

    def extra_repr(self) -> str:
        s = self.spec
        return f"layer={s.layer_id}, heads={s.num_heads}, kv_heads={s.num_kv_heads}, head_dim={s.head_dim}" + (
            f", sliding_window={s.sliding_window}" if s.sliding_window else ""
        )
