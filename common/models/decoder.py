"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3), written once over the shared layers.

Parameter names follow HF's, except that q/k/v and gate/up are fused into `qkv_proj` and `gate_up_proj` (one
matmul each); `checkpoint_target` maps a checkpoint tensor's name to the rows it fills.
"""

from __future__ import annotations

import torch
from torch import nn

from omnirun.attention.backend import AttentionBackend, AttentionLayerSpec
from omnirun.batch import ForwardBatch
from omnirun.layers.activation import SiluAndMul
from omnirun.layers.attention import PagedAttention
from omnirun.layers.embedding import LMHead, VocabEmbedding
from omnirun.layers.linear import Linear
from omnirun.layers.norm import RMSNorm
from omnirun.layers.ops import Ops
from omnirun.layers.rotary import RotaryEmbedding
from omnirun.models.architecture import DecoderShape


class SelfAttention(nn.Module):
    def __init__(self, shape: DecoderShape, layer_id: int, rotary: RotaryEmbedding, *, ops: Ops, dtype: torch.dtype):
        super().__init__()
        self.q_size = shape.num_heads * shape.head_dim
        self.kv_size = shape.num_kv_heads * shape.head_dim
        self.head_dim = shape.head_dim
        self.qkv_proj = Linear(
            shape.hidden_size,
            {"q": self.q_size, "k": self.kv_size, "v": self.kv_size},
            bias=shape.qkv_bias,
            ops=ops,
            dtype=dtype,
        )
        self.o_proj = Linear(self.q_size, shape.hidden_size, bias=shape.o_bias, ops=ops, dtype=dtype)
        if shape.qk_norm:
            self.q_norm = RMSNorm(shape.head_dim, shape.rms_norm_eps, ops=ops, dtype=dtype)
            self.k_norm = RMSNorm(shape.head_dim, shape.rms_norm_eps, ops=ops, dtype=dtype)
        self.qk_norm = shape.qk_norm
        self.rotary = rotary
        self.attn = PagedAttention(
            AttentionLayerSpec(
                layer_id=layer_id,
                num_heads=shape.num_heads,
                num_kv_heads=shape.num_kv_heads,
                head_dim=shape.head_dim,
                scaling=shape.head_dim**-0.5,
                sliding_window=shape.sliding_windows[layer_id],
            )
        )

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch, backend: AttentionBackend
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm:
            q = self.q_norm(q.reshape(-1, self.head_dim)).view(q.shape)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view(k.shape)
        q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v, batch, backend))


class MLP(nn.Module):
    def __init__(self, shape: DecoderShape, *, ops: Ops, dtype: torch.dtype):
        super().__init__()
        size = shape.intermediate_size
        gate_up = {"gate": size, "up": size}
        self.gate_up_proj = Linear(shape.hidden_size, gate_up, bias=shape.mlp_bias, ops=ops, dtype=dtype)
        self.down_proj = Linear(size, shape.hidden_size, bias=shape.mlp_bias, ops=ops, dtype=dtype)
        self.act = SiluAndMul(ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, shape: DecoderShape, layer_id: int, rotary: RotaryEmbedding, *, ops: Ops, dtype: torch.dtype):
        super().__init__()
        self.self_attn = SelfAttention(shape, layer_id, rotary, ops=ops, dtype=dtype)
        self.mlp = MLP(shape, ops=ops, dtype=dtype)
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps, ops=ops, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps, ops=ops, dtype=dtype)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        batch: ForwardBatch,
        backend: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual add closing each block is fused into the norm opening the next one.
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, batch, backend)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    def __init__(self, shape: DecoderShape, rotary: RotaryEmbedding, *, ops: Ops, dtype: torch.dtype):
        super().__init__()
        self.embed_tokens = VocabEmbedding(shape.vocab_size, shape.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(shape, i, rotary, ops=ops, dtype=dtype) for i in range(shape.num_layers)
        )
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps, ops=ops, dtype=dtype)

    def forward(self, batch: ForwardBatch, backend: AttentionBackend) -> torch.Tensor:
        hidden = self.embed_tokens(batch.input_ids)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(batch.positions, hidden, residual, batch, backend)
        if residual is None:  # a model without layers
            return self.norm(hidden)
        return self.norm(hidden, residual)[0]


class DecoderForCausalLM(nn.Module):
    """hidden states for a batch (`forward`) and logits for chosen rows of them (`compute_logits`)."""

    # checkpoint projection -> (fused parameter, its shard)
    FUSED_PROJECTIONS = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
    }

    def __init__(self, shape: DecoderShape, config, *, max_positions: int, ops: Ops, dtype: torch.dtype):
        super().__init__()
        self.shape = shape
        rotary = RotaryEmbedding(config, shape.head_dim, max_positions, ops=ops)
        self.model = DecoderModel(shape, rotary, ops=ops, dtype=dtype)
        tied = self.model.embed_tokens if shape.tie_word_embeddings else None
        self.lm_head = LMHead(shape.vocab_size, shape.hidden_size, ops=ops, dtype=dtype, tied_to=tied)

    def forward(self, batch: ForwardBatch, backend: AttentionBackend) -> torch.Tensor:
        return self.model(batch, backend)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def prepare_weights(self) -> None:
        """Give the platform its look at every matmul weight (after loading, and after each weight update)."""
        for module in self.modules():
            if isinstance(module, (Linear, LMHead)):
                module.prepare()

    def checkpoint_target(self, name: str) -> torch.Tensor | None:
        """The parameter rows an HF checkpoint tensor `name` fills; None for tensors to skip; KeyError if unknown."""
        if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and self.lm_head.tied):
            return None  # recomputed at start-up / the tied head reads the embedding
        module_path, _, param_name = name.rpartition(".")
        parent_path, _, leaf = module_path.rpartition(".")
        if leaf in self.FUSED_PROJECTIONS:
            fused, shard = self.FUSED_PROJECTIONS[leaf]
            try:
                linear = self.get_submodule(f"{parent_path}.{fused}")
            except AttributeError as exc:
                raise KeyError(name) from exc
            if getattr(linear, param_name, None) is None:
                raise KeyError(name)
            return linear.shard_view(param_name, shard)
        try:
            return self.get_parameter(name).data
        except AttributeError as exc:
            raise KeyError(name) from exc

    def checkpoint_names(self) -> list[str]:
        """The HF names of every tensor a complete checkpoint of this model holds (the inverse of the fusing)."""
        shards = {}
        for leaf, (fused, shard) in self.FUSED_PROJECTIONS.items():
            shards.setdefault(fused, []).append((leaf, shard))
        names = []
        for name, _ in self.named_parameters():
            module_path, _, param_name = name.rpartition(".")
            parent_path, _, leaf = module_path.rpartition(".")
            if leaf in shards:
                names.extend(f"{parent_path}.{hf_leaf}.{param_name}" for hf_leaf, _ in shards[leaf])
            else:
                names.append(name)
        return names
