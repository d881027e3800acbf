"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3), written once over the shared layers.

Parameter names follow HF's, except that q/k/v and gate/up are fused into `qkv_proj` and `gate_up_proj` (one
matmul each); `checkpoint_target` maps a checkpoint tensor's name to the rows it fills.

Tensor parallelism (Megatron): every rank builds the same module tree holding its own block of each weight, as
`TPLayout` assigns them: q/k/v and gate/up column-parallel (whole heads per rank; kv heads replicated when fewer
than ranks), o_proj and down row-parallel with an all-reduce, embedding and LM head vocab-parallel. Norm weights
(q/k norms are per head_dim) are whole on every rank. At one rank nothing is split and nothing is communicated.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from omnirun.attention.backend import AttentionBackend, AttentionLayerSpec, Rotary
from omnirun.batch import ForwardBatch
from omnirun.distributed.tensor_parallel import TensorParallel
from omnirun.layers.activation import SiluAndMul
from omnirun.layers.attention import PagedAttention
from omnirun.layers.embedding import LMHead, VocabEmbedding
from omnirun.layers.linear import Linear, QuantizedOf, RowParallelLinear, full_precision
from omnirun.layers.moe import SparseMoE
from omnirun.layers.norm import RMSNorm
from omnirun.layers.ops import Ops
from omnirun.layers.prepared import refresh_in_place
from omnirun.layers.rotary import RotaryEmbedding
from omnirun.layers.sharding import ShardTarget, Slice
from omnirun.models.architecture import DecoderShape
from omnirun.models.tp_layout import TPLayout, tp_layout

KV_SCALES = ("k_scale", "v_scale")


class SelfAttention(nn.Module):
    def __init__(
        self,
        shape: DecoderShape,
        layer_id: int,
        rotary: RotaryEmbedding,
        *,
        ops: Ops,
        dtype: torch.dtype,
        tp: TensorParallel,
        layout: TPLayout,
        quantized_of: QuantizedOf = full_precision,
    ):
        super().__init__()
        prefix = f"model.layers.{layer_id}.self_attn"
        hd = self.head_dim = shape.head_dim
        q = Slice(shape.num_heads * hd, layout.head_start * hd, layout.num_heads * hd)
        kv = Slice(shape.num_kv_heads * hd, layout.kv_head_start * hd, layout.num_kv_heads * hd)
        self.q_size, self.kv_size = q.size, kv.size
        qkv_kept = quantized_of([f"{prefix}.{p}_proj" for p in "qkv"])
        self.qkv_proj = Linear(
            shape.hidden_size, {"q": q, "k": kv, "v": kv}, bias=shape.qkv_bias, ops=ops, dtype=dtype, quantized=qkv_kept
        )
        o_kept = quantized_of([f"{prefix}.o_proj"])
        self.o_proj = RowParallelLinear(
            q, shape.hidden_size, bias=shape.o_bias, ops=ops, dtype=dtype, tp=tp, quantized=o_kept
        )
        if shape.qk_norm:
            self.q_norm = RMSNorm(shape.head_dim, shape.rms_norm_eps, ops=ops, dtype=dtype)
            self.k_norm = RMSNorm(shape.head_dim, shape.rms_norm_eps, ops=ops, dtype=dtype)
        self.qk_norm = shape.qk_norm
        self.rotary = rotary
        self.attn = PagedAttention(
            AttentionLayerSpec(
                layer_id=layer_id,
                num_heads=layout.num_heads,
                num_kv_heads=layout.num_kv_heads,
                head_dim=shape.head_dim,
                scaling=shape.head_dim**-0.5,
                sliding_window=shape.sliding_windows[layer_id],
            )
        )
        # An fp8 KV cache's scales for this layer, where the checkpoint has them (`self_attn.k_scale` and `.v_scale`:
        # compressed-tensors' kv_cache_scheme, vLLM's fp8 checkpoints); buffers, not parameters, since most
        # checkpoints have none (1.0). The runner hands them to the KV cache, which applies them only when fp8.
        for name in KV_SCALES:
            self.register_buffer(name, torch.ones((), dtype=torch.float32), persistent=False)

    def forward(
        self, rotary: Rotary, hidden: torch.Tensor, batch: ForwardBatch, backend: AttentionBackend
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm:
            q = self.q_norm(q.reshape(-1, self.head_dim)).view(q.shape)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view(k.shape)
        # The backend rotates q and k (by itself, or fused into its KV store).
        return self.o_proj(self.attn(q, k, v, batch, backend, rotary))


class MLP(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        columns: Slice,
        bias: bool,
        *,
        ops: Ops,
        dtype: torch.dtype,
        tp: TensorParallel,
        prefix: str = "mlp",
        quantized_of: QuantizedOf = full_precision,
    ):
        super().__init__()
        gate_up = {"gate": columns, "up": columns}
        gate_up_kept = quantized_of([f"{prefix}.gate_proj", f"{prefix}.up_proj"])
        self.gate_up_proj = Linear(hidden_size, gate_up, bias=bias, ops=ops, dtype=dtype, quantized=gate_up_kept)
        down_kept = quantized_of([f"{prefix}.down_proj"])
        self.down_proj = RowParallelLinear(
            columns, hidden_size, bias=bias, ops=ops, dtype=dtype, tp=tp, quantized=down_kept
        )
        self.act = SiluAndMul(ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


def _rank_columns(full: int, tp: TensorParallel) -> Slice:
    """This rank's block of `full` intermediate columns (tp_layout checked that they divide)."""
    size = full // tp.size
    return Slice(full, tp.rank * size, size)


def _mlp(
    shape: DecoderShape,
    layer_id: int,
    *,
    ops: Ops,
    dtype: torch.dtype,
    tp: TensorParallel,
    layout: TPLayout,
    quantized_of: QuantizedOf = full_precision,
) -> nn.Module:
    """Layer `layer_id`'s MLP: dense, or a mixture of experts where the shape says so (each expert's columns split
    over the ranks, or with expert parallelism this rank's experts whole)."""
    moe = shape.moe
    if moe is None or not moe.sparse_layers[layer_id]:
        columns = _rank_columns(shape.intermediate_size, tp)
        prefix = f"model.layers.{layer_id}.mlp"
        return MLP(
            shape.hidden_size,
            columns,
            shape.mlp_bias,
            ops=ops,
            dtype=dtype,
            tp=tp,
            prefix=prefix,
            quantized_of=quantized_of,
        )
    shared = None
    if moe.shared_intermediate_size:
        columns = _rank_columns(moe.shared_intermediate_size, tp)
        prefix = f"model.layers.{layer_id}.mlp.shared_expert"
        shared = MLP(
            shape.hidden_size, columns, False, ops=ops, dtype=dtype, tp=tp, prefix=prefix, quantized_of=quantized_of
        )
    # The experts' checkpoint modules (expert 0's stand for all: a config quantizes or ignores them alike).
    expert = f"model.layers.{layer_id}.{'block_sparse_moe' if moe.mixtral_names else 'mlp'}.experts.0"
    quantized = quantized_of([f"{expert}.{p}" for p in _expert_projections(moe.mixtral_names)])
    if layout.expert_parallel:
        columns = Slice.whole(moe.intermediate_size)
        experts = range(layout.expert_start, layout.expert_start + layout.experts_per_rank)
    else:
        columns, experts = _rank_columns(moe.intermediate_size, tp), range(moe.num_experts)
    return SparseMoE(
        shape.hidden_size,
        moe.num_experts,
        experts,
        moe.top_k,
        moe.renormalize,
        columns,
        ops=ops,
        dtype=dtype,
        tp=tp,
        shared=shared,
        quantized=quantized,
    )


class DecoderLayer(nn.Module):
    def __init__(
        self,
        shape: DecoderShape,
        layer_id: int,
        rotary: RotaryEmbedding,
        *,
        ops: Ops,
        dtype: torch.dtype,
        tp: TensorParallel,
        layout: TPLayout,
        quantized_of: QuantizedOf = full_precision,
    ):
        super().__init__()
        parts = dict(ops=ops, dtype=dtype, tp=tp, layout=layout, quantized_of=quantized_of)
        self.self_attn = SelfAttention(shape, layer_id, rotary, **parts)
        self.mlp = _mlp(shape, layer_id, **parts)
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps, ops=ops, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps, ops=ops, dtype=dtype)

    def forward(
        self,
        rotary: Rotary,
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
        hidden = self.self_attn(rotary, hidden, batch, backend)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    def __init__(
        self,
        shape: DecoderShape,
        rotary: RotaryEmbedding,
        *,
        ops: Ops,
        dtype: torch.dtype,
        tp: TensorParallel,
        layout: TPLayout,
        quantized_of: QuantizedOf = full_precision,
    ):
        super().__init__()
        self.embed_tokens = VocabEmbedding(shape.vocab_size, shape.hidden_size, dtype=dtype, tp=tp)
        self.layers = nn.ModuleList(
            DecoderLayer(shape, i, rotary, ops=ops, dtype=dtype, tp=tp, layout=layout, quantized_of=quantized_of)
            for i in range(shape.num_layers)
        )
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps, ops=ops, dtype=dtype)
        self.rotary = rotary  # the layers' shared table

    def forward(self, batch: ForwardBatch, backend: AttentionBackend) -> torch.Tensor:
        hidden = self.embed_tokens(batch.input_ids)
        residual = None
        rotary = self.rotary.at(batch.positions)
        for layer in self.layers:
            hidden, residual = layer(rotary, hidden, residual, batch, backend)
        if residual is None:  # a model without layers
            return self.norm(hidden)
        return self.norm(hidden, residual)[0]


# An expert's projection in a checkpoint: Qwen's `mlp.experts.3.gate_proj.weight`, Mixtral's
# `block_sparse_moe.experts.3.w1.weight` (read as `mlp.`); its scales where the experts stay in fp8, its packed words,
# scales and zero points where they stay in int4.
_EXPERT = re.compile(
    r"(?P<moe>.+\.mlp)\.experts\.(?P<id>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w3|w2)\.(?P<param>weight|weight_scale|weight_packed|weight_zero_point)"
)
_EXPERT_PROJECTIONS = {
    "gate_proj": "gate",
    "up_proj": "up",
    "down_proj": "down",
    "w1": "gate",
    "w3": "up",
    "w2": "down",
}


def _expert_names(moe_path: str, moe: SparseMoE, mixtral: bool) -> list[str]:
    """The checkpoint names of the projections of the experts (this rank's) of the MoE module at `moe_path`."""
    prefix = moe_path.replace(".mlp", ".block_sparse_moe") if mixtral else moe_path
    projections = _expert_projections(mixtral)
    params = moe.checkpoint_params()
    return [f"{prefix}.experts.{e}.{p}.{param}" for e in moe.experts for p in projections for param in params]


def _expert_projections(mixtral: bool) -> tuple[str, str, str]:
    """An expert's gate, up and down projections as the checkpoint names them."""
    return ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")


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

    def __init__(
        self,
        shape: DecoderShape,
        config,
        *,
        max_positions: int,
        ops: Ops,
        dtype: torch.dtype,
        tp: TensorParallel | None = None,
        layout: TPLayout | None = None,
        quantized_of: QuantizedOf = full_precision,
    ):
        """`quantized_of` names the linear layers that keep the checkpoint's quantized weights (fp8 or int4, by their
        checkpoint modules)."""
        super().__init__()
        tp = tp or TensorParallel.single()
        layout = layout or tp_layout(shape, tp.size, tp.rank)
        if (layout.tp_rank, layout.tp_size) != (tp.rank, tp.size):
            raise ValueError(f"layout of rank {layout.tp_rank}/{layout.tp_size} given to rank {tp.rank}/{tp.size}")
        self.shape, self.tp, self.layout = shape, tp, layout
        rotary = RotaryEmbedding(config, shape.head_dim, max_positions, ops=ops)
        self.model = DecoderModel(shape, rotary, ops=ops, dtype=dtype, tp=tp, layout=layout, quantized_of=quantized_of)
        tied = self.model.embed_tokens if shape.tie_word_embeddings else None
        self.lm_head = LMHead(shape.vocab_size, shape.hidden_size, ops=ops, dtype=dtype, tied_to=tied, tp=tp)

    def forward(self, batch: ForwardBatch, backend: AttentionBackend) -> torch.Tensor:
        return self.model(batch, backend)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def kv_scales(self) -> tuple[list[float], list[float]]:
        """Each layer's k_scale and v_scale (1.0 unless the checkpoint had them). Syncs the host."""
        layers = [layer.self_attn for layer in self.model.layers]
        return [float(a.k_scale) for a in layers], [float(a.v_scale) for a in layers]

    def prepare_weights(self) -> bool:
        """Give the platform its look at every matmul weight (after loading, and after each weight update). A form
        made again goes into the memory of the one before where the two have the same structure, since captured
        graphs read that memory; False where some form could not (the graphs must then be captured again)."""
        in_place = True
        for module in self.modules():
            if isinstance(module, (Linear, LMHead, SparseMoE)):
                before = module.prepared
                module.prepare()
                if refresh_in_place(before, module.prepared):
                    module.prepared = before
                else:
                    in_place = False
        return in_place

    def checkpoint_target(self, name: str) -> ShardTarget | None:
        """Where HF checkpoint tensor `name` lands on this rank (the parameter rows or columns it fills, and which part
        of the full tensor they hold); None for tensors to skip; KeyError if unknown."""
        if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and self.lm_head.tied):
            return None  # recomputed at start-up / the tied head reads the embedding
        name = name.replace(".block_sparse_moe.", ".mlp.")  # Mixtral's name for the experts' module
        expert = _EXPERT.fullmatch(name)
        if expert is not None:
            try:
                moe = self.get_submodule(expert["moe"])
            except AttributeError as exc:
                raise KeyError(name) from exc
            if not isinstance(moe, SparseMoE) or not 0 <= int(expert["id"]) < moe.num_experts:
                raise KeyError(name)
            try:  # None: another rank's expert
                return moe.expert_target(int(expert["id"]), _EXPERT_PROJECTIONS[expert["proj"]], expert["param"])
            except KeyError:
                raise KeyError(name) from None
        module_path, _, param_name = name.rpartition(".")
        parent_path, _, leaf = module_path.rpartition(".")
        if leaf in self.FUSED_PROJECTIONS:
            fused, shard = self.FUSED_PROJECTIONS[leaf]
            try:
                linear = self.get_submodule(f"{parent_path}.{fused}")
            except AttributeError as exc:
                raise KeyError(name) from exc
            if not isinstance(linear, Linear):
                raise KeyError(name)
            try:
                return linear.checkpoint_slice(param_name, shard)
            except KeyError:
                raise KeyError(name) from None
        try:
            module = self.get_submodule(module_path)
        except AttributeError as exc:
            raise KeyError(name) from exc
        if isinstance(module, SelfAttention) and param_name in KV_SCALES:  # one per layer, whole on every rank
            return ShardTarget(module.get_buffer(param_name), ())
        if isinstance(module, Linear):  # o_proj, down_proj: split, and perhaps kept quantized
            try:
                return module.checkpoint_slice(param_name)
            except KeyError:
                raise KeyError(name) from None
        try:
            param = self.get_parameter(name)
        except AttributeError as exc:
            raise KeyError(name) from exc
        if hasattr(module, "checkpoint_slice"):  # split layers: o_proj, down_proj, embedding, head
            return module.checkpoint_slice(param_name)
        return ShardTarget(param.data, tuple(param.shape))  # norms: whole on every rank

    def checkpoint_names(self) -> list[str]:
        """The HF names of every tensor a complete checkpoint of this model holds (the inverse of the fusing)."""
        shards = {}
        for leaf, (fused, shard) in self.FUSED_PROJECTIONS.items():
            shards.setdefault(fused, []).append((leaf, shard))
        names = []
        moe = self.shape.moe
        for name, _ in self.named_parameters():
            module_path, _, param_name = name.rpartition(".")
            parent_path, _, leaf = module_path.rpartition(".")
            if param_name.startswith(("w13", "w2")):  # stacked experts (SparseMoE's w13*, w2*): one checkpoint
                if param_name in ("w13", "w13_packed"):  # tensor per expert, projection and parameter
                    names.extend(_expert_names(module_path, self.get_submodule(module_path), moe.mixtral_names))
                continue
            if moe is not None and moe.mixtral_names and name.endswith(".mlp.gate.weight"):
                names.append(name.replace(".mlp.", ".block_sparse_moe."))
            elif leaf in shards:
                names.extend(f"{parent_path}.{hf_leaf}.{param_name}" for hf_leaf, _ in shards[leaf])
            else:
                names.append(name)
        return names
