"""Rotary position embedding: the cos/sin table for every position, and the rotation of q and k.

The frequencies follow the checkpoint's `rope_parameters` (transformers 5): "default" is computed here; the scaled
variants whose frequencies do not depend on the sequence length (linear, llama3, yarn) are computed by transformers'
own `ROPE_INIT_FUNCTIONS`, so they are right by construction.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from omnirun.attention.backend import Rotary
from omnirun.errors import UnsupportedModelError
from omnirun.layers.ops import Ops

# Scalings whose frequencies change with the running sequence length would need per-step tables.
_LENGTH_DEPENDENT = ("dynamic", "longrope")


def rope_inverse_frequencies(config: Any, head_dim: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim / 2] float32, attention scaling applied to cos and sin)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    rope_type = params.get("rope_type", "default")
    if getattr(config, "partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError("partial rotary embeddings (partial_rotary_factor != 1) are not supported yet")
    if rope_type == "default":
        theta = float(params.get("rope_theta", 10000.0))
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").to(torch.float32) / head_dim
        return 1.0 / (theta**exponents), 1.0
    if rope_type in _LENGTH_DEPENDENT:
        raise UnsupportedModelError(f"rope_type {rope_type!r} is not supported: it rescales with the sequence length")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise UnsupportedModelError(f"rope_type {rope_type!r} is unknown to this transformers version")
    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    return inv_freq.float(), float(attention_scaling)


def cos_sin_table(inv_freq: torch.Tensor, attention_scaling: float, max_positions: int) -> torch.Tensor:
    """float32 [max_positions, head_dim]: cos of each frequency at each position, then sin (the layout fused rope
    kernels read). The products are taken in float32 as HF does, so the tables agree bit for bit."""
    positions = torch.arange(max_positions, dtype=torch.int64, device=inv_freq.device).to(torch.float32)
    freqs = torch.outer(positions, inv_freq)
    return torch.cat((freqs.cos() * attention_scaling, freqs.sin() * attention_scaling), dim=-1)


class RotaryEmbedding(nn.Module):
    """One table shared by every layer of a model."""

    def __init__(self, config: Any, head_dim: int, max_positions: int, *, ops: Ops):
        super().__init__()
        inv_freq, scaling = rope_inverse_frequencies(config, head_dim)
        # The frequencies are computed on the host (as HF does); the table is built where the model lives.
        inv_freq = inv_freq.to(torch.get_default_device())
        self.head_dim = head_dim
        self.ops = ops
        self.register_buffer("cos_sin_cache", cos_sin_table(inv_freq, scaling, max_positions), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ops.rotary_embedding(positions, q, k, self.cos_sin_cache, self.head_dim)

    def at(self, positions: torch.Tensor) -> Rotary:
        """The rotation of a batch's tokens, for the attention backend to apply (or fuse into its KV store)."""
        return Rotary(positions, self.cos_sin_cache, self.head_dim, functools.partial(self.forward, positions))
