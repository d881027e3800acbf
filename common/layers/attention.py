"""The attention layer as the model sees it: hands q/k/v to the batch's attention backend."""

from __future__ import annotations

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
        return backend.forward(q, k, v, self.spec, batch, rotary)

    def extra_repr(self) -> str:
        s = self.spec
        return f"layer={s.layer_id}, heads={s.num_heads}, kv_heads={s.num_kv_heads}, head_dim={s.head_dim}" + (
            f", sliding_window={s.sliding_window}" if s.sliding_window else ""
        )
