"""How the Llama-family checkpoints differ, read from their HF config into one small record."""

from __future__ import annotations

import dataclasses
from typing import Any

from omnirun.errors import UnsupportedModelError


@dataclasses.dataclass(frozen=True)
class MoEShape:
    """A mixture-of-experts MLP: which layers have one and how it routes."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of each expert
    renormalize: bool  # the top-k weights divided by their sum (Mixtral always; Qwen's norm_topk_prob)
    shared_intermediate_size: int  # Qwen2-MoE's shared expert, gated by a sigmoid (0: none)
    sparse_layers: tuple[bool, ...]  # per layer: experts (True) or the dense MLP of `intermediate_size`
    mixtral_names: bool = (
        False  # checkpoint names `block_sparse_moe.experts.N.w1/w3/w2` (else Qwen's `mlp.experts.N.*`)
    )


@dataclasses.dataclass(frozen=True)
class DecoderShape:
    """Everything the shared decoder needs from an HF config."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2 always, Llama/Qwen3 with attention_bias
    o_bias: bool  # Llama/Qwen3 with attention_bias
    mlp_bias: bool  # Llama with mlp_bias
    qk_norm: bool  # Qwen3: RMSNorm over each head of q and k before rope
    sliding_windows: tuple[int | None, ...]  # per layer; None = full attention
    moe: MoEShape | None = None  # None: every layer has the dense MLP

    @classmethod
    def from_config(
        cls, config: Any, *, qkv_bias: bool, o_bias: bool, mlp_bias: bool, qk_norm: bool, moe: MoEShape | None = None
    ) -> DecoderShape:
        num_heads = config.num_attention_heads
        return cls(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // num_heads,
            rms_norm_eps=config.rms_norm_eps,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=mlp_bias,
            qk_norm=qk_norm,
            sliding_windows=_sliding_windows(config),
            moe=moe,
        )


def _sliding_windows(config: Any) -> tuple[int | None, ...]:
    """Per-layer window as HF applies it: from `layer_types` where the config has them (Qwen2/3), else the config's
    `sliding_window` on every layer (Mistral), else none."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return tuple(window if kind == "sliding_attention" else None for kind in layer_types)
    return (window,) * config.num_hidden_layers


# Each supported `config.architectures` entry, and how its checkpoint departs from plain Llama (per HF's modeling code).
def _llama(config: Any) -> DecoderShape:
    bias = bool(getattr(config, "attention_bias", False))
    mlp_bias = bool(getattr(config, "mlp_bias", False))
    return DecoderShape.from_config(config, qkv_bias=bias, o_bias=bias, mlp_bias=mlp_bias, qk_norm=False)


def _mistral(config: Any) -> DecoderShape:
    return DecoderShape.from_config(config, qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False)


def _qwen2(config: Any) -> DecoderShape:
    return DecoderShape.from_config(config, qkv_bias=True, o_bias=False, mlp_bias=False, qk_norm=False)


def _qwen3(config: Any) -> DecoderShape:
    bias = bool(getattr(config, "attention_bias", False))
    return DecoderShape.from_config(config, qkv_bias=bias, o_bias=bias, mlp_bias=False, qk_norm=True)


def _mixtral(config: Any) -> DecoderShape:
    layers = config.num_hidden_layers
    moe = MoEShape(
        num_experts=config.num_local_experts,
        top_k=config.num_experts_per_tok,
        intermediate_size=config.intermediate_size,
        renormalize=True,
        shared_intermediate_size=0,
        sparse_layers=(True,) * layers,
        mixtral_names=True,
    )
    return DecoderShape.from_config(config, qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False, moe=moe)


def _qwen_moe(config: Any, shared: int) -> MoEShape:
    """Qwen2-MoE's and Qwen3-MoE's routing: experts on every `decoder_sparse_step`-th layer outside
    `mlp_only_layers`, as their HF decoder layers choose."""
    only_dense = set(getattr(config, "mlp_only_layers", None) or [])
    step = getattr(config, "decoder_sparse_step", 1) or 1
    sparse = tuple(
        i not in only_dense and config.num_experts > 0 and (i + 1) % step == 0 for i in range(config.num_hidden_layers)
    )
    return MoEShape(
        config.num_experts,
        config.num_experts_per_tok,
        config.moe_intermediate_size,
        bool(config.norm_topk_prob),
        shared,
        sparse,
    )


def _qwen2_moe(config: Any) -> DecoderShape:
    moe = _qwen_moe(config, config.shared_expert_intermediate_size or 0)
    bias = bool(getattr(config, "qkv_bias", True))
    return DecoderShape.from_config(config, qkv_bias=bias, o_bias=False, mlp_bias=False, qk_norm=False, moe=moe)


def _qwen3_moe(config: Any) -> DecoderShape:
    bias = bool(getattr(config, "attention_bias", False))
    moe = _qwen_moe(config, 0)
    return DecoderShape.from_config(config, qkv_bias=bias, o_bias=bias, mlp_bias=False, qk_norm=True, moe=moe)


ARCHITECTURES = {
    "LlamaForCausalLM": _llama,
    "MistralForCausalLM": _mistral,
    "Qwen2ForCausalLM": _qwen2,
    "Qwen3ForCausalLM": _qwen3,
    "MixtralForCausalLM": _mixtral,
    "Qwen2MoeForCausalLM": _qwen2_moe,
    "Qwen3MoeForCausalLM": _qwen3_moe,
}


def decoder_shape(config: Any) -> DecoderShape:
    """The shape of the checkpoint's architecture; an unknown one is an error listing what is supported."""
    names = list(getattr(config, "architectures", None) or [])
    for name in names:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name](config)
    found = ", ".join(names) if names else "none (config.json has no 'architectures')"
    raise UnsupportedModelError(
        f"architecture {found} is not supported: omnirun runs {', '.join(sorted(ARCHITECTURES))}"
    )
