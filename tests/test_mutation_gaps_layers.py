"""Layer details the mutation run found unchecked."""

from __future__ import annotations

import pytest
import torch

from omnirun.attention.backend import AttentionLayerSpec
from omnirun.layers import native_ops
from omnirun.layers.attention import PagedAttention
from omnirun.layers.norm import RMSNorm
from omnirun.layers.ops import Ops, resolve_ops


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
