"""How the Llama-family checkpoints differ, read from their HF config into one small record."""

from __future__ import annotations

import dataclasses
from typing import Any

from omnirun.errors import UnsupportedModelError


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

    @classmethod
    def from_config(cls, config: Any, *, qkv_bias: bool, o_bias: bool, mlp_bias: bool, qk_norm: bool) -> DecoderShape:
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


ARCHITECTURES = {
    "LlamaForCausalLM": _llama,
    "MistralForCausalLM": _mistral,
    "Qwen2ForCausalLM": _qwen2,
    "Qwen3ForCausalLM": _qwen3,
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
