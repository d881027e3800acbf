"""Layer details: rotary parameters, norms and the other small cases of the layers."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from omnirun.attention.backend import AttentionLayerSpec
from omnirun.errors import UnsupportedModelError
from omnirun.layers import native_ops
from omnirun.layers.attention import PagedAttention
from omnirun.layers.norm import RMSNorm
from omnirun.layers.ops import Ops, resolve_ops
from omnirun.layers.rotary import RotaryEmbedding, rope_inverse_frequencies


def test_the_attention_layer_prints_its_shape_and_window():
    spec = AttentionLayerSpec(layer_id=3, num_heads=8, num_kv_heads=2, head_dim=64, scaling=0.125)
    assert repr(PagedAttention(spec)) == "PagedAttention(layer=3, heads=8, kv_heads=2, head_dim=64)"
    windowed = AttentionLayerSpec(3, 8, 2, 64, 0.125, sliding_window=4096)
    assert repr(PagedAttention(windowed)) == (
        "PagedAttention(layer=3, heads=8, kv_heads=2, head_dim=64, sliding_window=4096)"
    )


def test_rms_norm_normalises_the_last_dimension_of_any_shape_as_hf():
    """Per-head norms (qwen3's q/k norm) see [tokens, heads, head_dim]: the statistic is over the last dimension."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x = torch.randn(3, 4, 8, generator=torch.Generator().manual_seed(0))
    ref = LlamaRMSNorm(8, eps=1e-6)
    with torch.no_grad():
        ref.weight.copy_(torch.linspace(0.5, 1.5, 8))
        expected = ref(x)
    assert torch.equal(native_ops.rms_norm(x, ref.weight.detach(), 1e-6), expected)


def test_silu_and_mul_halves_the_last_dimension_of_any_shape():
    x = torch.randn(3, 4, 10, generator=torch.Generator().manual_seed(1))
    expected = torch.nn.functional.silu(x[..., :5]) * x[..., 5:]
    assert torch.equal(native_ops.silu_and_mul(x), expected)


def test_a_norm_weight_is_an_inference_parameter_of_the_model_dtype():
    norm = RMSNorm(8, 1e-5, ops=Ops(), dtype=torch.bfloat16)
    assert norm.weight.shape == (8,) and norm.weight.dtype == torch.bfloat16
    assert norm.weight.requires_grad is False and norm.eps == 1e-5


def test_a_platform_offering_linear_without_its_prepare_is_told_why():
    with pytest.raises(ValueError) as excinfo:
        resolve_ops({"linear": native_ops.linear})
    assert str(excinfo.value) == (
        "a platform offering `linear` must offer `prepare_linear` too (they agree on a format)"
    )


@pytest.mark.parametrize(
    ("config", "theta"),
    [
        (SimpleNamespace(), 10000.0),  # no rope_parameters at all: the default rope, theta 10000
        (SimpleNamespace(rope_parameters={"rope_theta": 500000.0}), 500000.0),  # no rope_type: the default rope
    ],
)
def test_default_rope_frequencies_when_the_config_names_no_rope_type(config, theta):
    inv_freq, scaling = rope_inverse_frequencies(config, 8)
    # 1 / theta^(2i / head_dim) for i = 0..3 (the RoPE paper's frequencies)
    expected = torch.tensor([1.0, theta**-0.25, theta**-0.5, theta**-0.75], dtype=torch.float32)
    assert torch.allclose(inv_freq, expected, rtol=1e-6) and scaling == 1.0


def test_the_rotary_table_is_built_on_the_models_device_and_is_not_a_checkpoint_tensor():
    config = SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    rope = RotaryEmbedding(config, head_dim=8, max_positions=16, ops=Ops())
    assert rope.cos_sin_cache.shape == (16, 8)
    assert "cos_sin_cache" not in rope.state_dict()  # recomputed, never loaded or saved
    with torch.device("meta"):  # the model is built under its device
        assert RotaryEmbedding(config, 8, 16, ops=Ops()).cos_sin_cache.device.type == "meta"


def test_the_frequencies_are_computed_on_the_host_whatever_the_default_device():
    with torch.device("meta"):  # as when the model is built on its device
        inv_freq, _ = rope_inverse_frequencies(SimpleNamespace(), 8)
    assert inv_freq.device.type == "cpu"
    assert torch.allclose(inv_freq, torch.tensor([1.0, 0.1, 0.01, 0.001]), rtol=1e-6)  # theta 10000, head_dim 8


def test_partial_rotary_embeddings_are_refused_by_name():
    with pytest.raises(UnsupportedModelError) as excinfo:
        rope_inverse_frequencies(SimpleNamespace(partial_rotary_factor=0.5), 8)
    assert str(excinfo.value) == "partial rotary embeddings (partial_rotary_factor != 1) are not supported yet"
    rope_inverse_frequencies(SimpleNamespace(partial_rotary_factor=1.0), 8)  # 1 is the whole head: fine


@pytest.mark.parametrize(
    ("rope_type", "message"),
    [
        ("dynamic", "rope_type 'dynamic' is not supported: it rescales with the sequence length"),
        ("longrope", "rope_type 'longrope' is not supported: it rescales with the sequence length"),
        ("no_such_rope", "rope_type 'no_such_rope' is unknown to this transformers version"),
    ],
)
def test_rope_types_that_cannot_be_served_are_refused_by_name(rope_type, message):
    config = SimpleNamespace(rope_parameters={"rope_type": rope_type, "rope_theta": 10000.0, "factor": 2.0})
    with pytest.raises(UnsupportedModelError) as excinfo:
        rope_inverse_frequencies(config, 8)
    assert str(excinfo.value) == message
