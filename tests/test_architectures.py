"""Reading HF configs into the decoder's shape: per-architecture features, sliding windows, unsupported inputs."""

from __future__ import annotations

import pytest

from omnirun.errors import UnsupportedModelError
from omnirun.loader import preset_config
from omnirun.models.architecture import ARCHITECTURES, decoder_shape
from omnirun.testing import tiny_configs


def test_each_architecture_reads_its_features():
    configs = tiny_configs()
    llama, qwen2, qwen3, mistral = (decoder_shape(configs[a]) for a in ("llama", "qwen2", "qwen3", "mistral"))
    assert (llama.qkv_bias, llama.qk_norm, llama.sliding_windows) == (False, False, (None, None))
    assert (qwen2.qkv_bias, qwen2.o_bias, qwen2.sliding_windows) == (True, False, (None, 16))
    assert (qwen3.qk_norm, qwen3.head_dim, qwen3.tie_word_embeddings) == (True, 32, True)
    assert mistral.sliding_windows == (16, 16)


def test_presets_have_real_shapes():
    llama = decoder_shape(preset_config("llama-3-8b"))
    assert (llama.num_layers, llama.num_kv_heads, llama.head_dim, llama.vocab_size) == (32, 8, 128, 128256)
    qwen = decoder_shape(preset_config("qwen2.5-0.5b"))
    assert (qwen.qkv_bias, qwen.tie_word_embeddings, qwen.num_kv_heads, qwen.head_dim) == (True, True, 2, 64)


def test_unknown_or_missing_architecture():
    config = tiny_configs()["llama"]
    config.architectures = ["FalconForCausalLM"]
    with pytest.raises(
        UnsupportedModelError,
        match="FalconForCausalLM is not supported: omnirun runs " + ", ".join(sorted(ARCHITECTURES)),
    ):
        decoder_shape(config)
    config.architectures = None
    with pytest.raises(UnsupportedModelError, match="config.json has no 'architectures'"):
        decoder_shape(config)
