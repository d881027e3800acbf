"""Real model shapes for `--load-format dummy`: benchmark a model's shape without downloading its weights.

The numbers are copied from each model's published `config.json` on the Hugging Face Hub.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import torch
from transformers import (
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

from omnirun.errors import ModelLoadError


@dataclasses.dataclass(frozen=True)
class Preset:
    """A transformers config class and the keyword arguments that give one published model's shape."""

    config_class: type[PretrainedConfig]
    kwargs: Mapping[str, Any]
    description: str = ""

    def build(self) -> PretrainedConfig:
        """A fresh config object (configs are mutable, so never hand out a shared one, nor shared rope dicts)."""
        return self.config_class(**copy.deepcopy(dict(self.kwargs)))


def _preset(config_class: type[PretrainedConfig], description: str, **kwargs: Any) -> Preset:
    return Preset(config_class, MappingProxyType(kwargs), description)


_LLAMA_3_8B = dict(
    architectures=["LlamaForCausalLM"],
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    tie_word_embeddings=False,
    bos_token_id=128000,
    eos_token_id=128001,
    dtype=torch.bfloat16,
)

# Quantized 8B checkpoints as published: RedHatAI/Meta-Llama-3-8B-Instruct-FP8-dynamic (llm-compressor: fp8 weights
# per output channel, activations per token at run time, lm_head left out), and the block-wise layout DeepSeek-V3
# and Qwen3-FP8 ship (`quant_method: "fp8"`, 128 x 128 blocks, `weight_scale_inv`).
_FP8_PER_CHANNEL = {
    "quant_method": "compressed-tensors",
    "format": "float-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True},
        }
    },
    "ignore": ["lm_head"],
}
_FP8_BLOCK = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
# hugging-quants/Meta-Llama-3.1-8B-Instruct-AWQ-INT4 (AutoAWQ's GEMM layout, 4 bits, groups of 128 with zero points;
# its modules_to_not_convert is null: every decoder projection quantized, the embedding and lm_head never are).
_AWQ_INT4 = {
    "quant_method": "awq",
    "bits": 4,
    "group_size": 128,
    "zero_point": True,
    "version": "gemm",
    "modules_to_not_convert": None,
}

_QWEN3_30B_A3B = dict(
    architectures=["Qwen3MoeForCausalLM"],
    hidden_size=2048,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    num_hidden_layers=48,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    vocab_size=151936,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    tie_word_embeddings=False,
    attention_bias=False,
    use_sliding_window=False,
    bos_token_id=151643,
    eos_token_id=151645,
    dtype=torch.bfloat16,
)

PRESETS: Mapping[str, Preset] = MappingProxyType(
    {
        "llama-3-8b": _preset(LlamaConfig, "Meta-Llama-3-8B", **_LLAMA_3_8B),
        "llama-3-8b-fp8": _preset(
            LlamaConfig, "Meta-Llama-3-8B, fp8 per channel", **_LLAMA_3_8B, quantization_config=_FP8_PER_CHANNEL
        ),
        "llama-3-8b-fp8-block": _preset(
            LlamaConfig, "Meta-Llama-3-8B, fp8 in 128 x 128 blocks", **_LLAMA_3_8B, quantization_config=_FP8_BLOCK
        ),
        "llama-3-8b-awq": _preset(
            LlamaConfig, "Meta-Llama-3-8B, AWQ int4 in groups of 128", **_LLAMA_3_8B, quantization_config=_AWQ_INT4
        ),
        "llama-3.1-8b": _preset(
            LlamaConfig,
            "Meta-Llama-3.1-8B",
            **{
                **_LLAMA_3_8B,
                "max_position_embeddings": 131072,
                "rope_parameters": {
                    "rope_type": "llama3",
                    "rope_theta": 500000.0,
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192,
                },
            },
        ),
        "qwen2.5-0.5b": _preset(
            Qwen2Config,
            "Qwen2.5-0.5B-Instruct",
            architectures=["Qwen2ForCausalLM"],
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            vocab_size=151936,
            max_position_embeddings=32768,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            tie_word_embeddings=True,
            use_sliding_window=False,
            bos_token_id=151643,
            eos_token_id=151645,
            dtype=torch.bfloat16,
        ),
        "qwen3-0.6b": _preset(
            Qwen3Config,
            "Qwen3-0.6B",
            architectures=["Qwen3ForCausalLM"],
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=151936,
            max_position_embeddings=40960,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            tie_word_embeddings=True,
            attention_bias=False,
            use_sliding_window=False,
            bos_token_id=151643,
            eos_token_id=151645,
            dtype=torch.bfloat16,
        ),
        "mistral-7b-v0.3": _preset(
            MistralConfig,
            "Mistral-7B-v0.3",
            architectures=["MistralForCausalLM"],
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=32768,
            max_position_embeddings=32768,
            rms_norm_eps=1e-5,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            sliding_window=None,
            tie_word_embeddings=False,
            bos_token_id=1,
            eos_token_id=2,
            dtype=torch.bfloat16,
        ),
        # Mixtures of experts.
        "qwen3-30b-a3b": _preset(Qwen3MoeConfig, "Qwen3-30B-A3B", **_QWEN3_30B_A3B),
        # as Qwen/Qwen3-30B-A3B-FP8 ships it: every projection (the experts' too) in 128 x 128 fp8 blocks
        "qwen3-30b-a3b-fp8": _preset(
            Qwen3MoeConfig, "Qwen3-30B-A3B, fp8 in 128 x 128 blocks", **_QWEN3_30B_A3B, quantization_config=_FP8_BLOCK
        ),
        # AWQ int4 in groups of 128, every decoder projection (the experts' too), as AutoAWQ quantizes a Qwen3-MoE
        "qwen3-30b-a3b-awq": _preset(
            Qwen3MoeConfig, "Qwen3-30B-A3B, AWQ int4 in groups of 128", **_QWEN3_30B_A3B, quantization_config=_AWQ_INT4
        ),
        "mixtral-8x7b": _preset(
            MixtralConfig,
            "Mixtral-8x7B-v0.1",
            architectures=["MixtralForCausalLM"],
            hidden_size=4096,
            intermediate_size=14336,
            num_local_experts=8,
            num_experts_per_tok=2,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=32000,
            max_position_embeddings=32768,
            rms_norm_eps=1e-5,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            sliding_window=None,
            tie_word_embeddings=False,
            bos_token_id=1,
            eos_token_id=2,
            dtype=torch.bfloat16,
        ),
        "qwen2-moe-a2.7b": _preset(
            Qwen2MoeConfig,
            "Qwen1.5-MoE-A2.7B",
            architectures=["Qwen2MoeForCausalLM"],
            hidden_size=2048,
            intermediate_size=5632,
            moe_intermediate_size=1408,
            shared_expert_intermediate_size=5632,
            num_experts=60,
            num_experts_per_tok=4,
            norm_topk_prob=False,
            decoder_sparse_step=1,
            num_hidden_layers=24,
            num_attention_heads=16,
            num_key_value_heads=16,
            vocab_size=151936,
            max_position_embeddings=8192,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            tie_word_embeddings=False,
            use_sliding_window=False,
            bos_token_id=151643,
            eos_token_id=151643,
            dtype=torch.bfloat16,
        ),
        # Tiny shapes for tests and smoke runs; float32 so results compare tightly against references on any device.
        "tiny-llama": _preset(
            LlamaConfig,
            "tiny Llama for tests",
            architectures=["LlamaForCausalLM"],
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=512,
            max_position_embeddings=256,
            rms_norm_eps=1e-5,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            tie_word_embeddings=False,
            dtype=torch.float32,
        ),
        "tiny-qwen3": _preset(
            Qwen3Config,
            "tiny Qwen3 for tests (q/k norms, tied embeddings)",
            architectures=["Qwen3ForCausalLM"],
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            vocab_size=512,
            max_position_embeddings=256,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            tie_word_embeddings=True,
            use_sliding_window=False,
            dtype=torch.float32,
        ),
    }
)


def preset_names() -> list[str]:
    """The names `--load-format dummy` accepts as a model, in a stable order."""
    return list(PRESETS)


def preset_config(name: str) -> PretrainedConfig:
    """A fresh transformers config with the named preset's shape."""
    preset = PRESETS.get(name)
    if preset is None:
        raise ModelLoadError(f"unknown model preset {name!r}: choose one of {', '.join(PRESETS)}")
    return preset.build()
