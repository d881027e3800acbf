"""The shared layers against HF transformers' own modules, and the platform's fused-op overlay."""

from __future__ import annotations

import collections

import pytest
import torch

from omnirun.devices.cpu.platform import CpuPlatform
from omnirun.layers import native_ops
from omnirun.layers.ops import Ops, resolve_ops
from omnirun.layers.rotary import cos_sin_table, rope_inverse_frequencies


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_norm_is_bit_identical_to_hf(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    hf = LlamaRMSNorm(64, eps=1e-6).to(dtype)
    torch.nn.init.normal_(hf.weight)
    x = torch.randn(5, 64, dtype=dtype)
    residual = torch.randn(5, 64, dtype=dtype)
    assert torch.equal(native_ops.rms_norm(x, hf.weight, 1e-6), hf(x))
    normed, summed = native_ops.add_rms_norm(x, residual, hf.weight, 1e-6)
    assert torch.equal(summed, x + residual) and torch.equal(normed, hf(x + residual))


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64},
    ],
    ids=lambda r: r["rope_type"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_is_bit_identical_to_hf(rope, dtype):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    config = LlamaConfig(hidden_size=128, num_attention_heads=2, max_position_embeddings=256, rope_parameters=rope)
    positions = torch.tensor([0, 1, 2, 50, 200, 255])
    q = torch.randn(6, 2 * 64, dtype=dtype)
    k = torch.randn(6, 1 * 64, dtype=dtype)
    cos, sin = LlamaRotaryEmbedding(config)(q, positions[None])
    hf_q, hf_k = apply_rotary_pos_emb(
        q.view(1, 6, 2, 64).transpose(1, 2), k.view(1, 6, 1, 64).transpose(1, 2), cos, sin
    )
    table = cos_sin_table(*rope_inverse_frequencies(config, 64), 256)
    ours_q, ours_k = native_ops.rotary_embedding(positions, q, k, table, 64)
    assert torch.equal(ours_q, hf_q.transpose(1, 2).reshape(6, -1))
    assert torch.equal(ours_k, hf_k.transpose(1, 2).reshape(6, -1))


def test_silu_and_mul():
    x = torch.randn(3, 2 * 16)
    torch.testing.assert_close(native_ops.silu_and_mul(x), torch.nn.functional.silu(x[:, :16]) * x[:, 16:])


def test_unknown_fused_op_is_an_error():
    with pytest.raises(ValueError, match="'gelu_tanh'"):
        resolve_ops({"gelu_tanh": torch.tanh})
    assert resolve_ops({}) == Ops()


class CountingCpuPlatform(CpuPlatform):
    """A cpu platform that offers every op as a "fused" kernel (the reference, counted)."""

    calls: collections.Counter = collections.Counter()

    def fused_ops(self):
        def counted(name):
            def op(*args, **kwargs):
                self.calls[name] += 1
                return getattr(native_ops, name)(*args, **kwargs)

            return op

        return {name: counted(name) for name in ("rms_norm", "add_rms_norm", "silu_and_mul", "rotary_embedding")}


def test_layers_use_the_platforms_fused_ops(tmp_path):
    from omnirun.testing import greedy_generate, make_runner, tiny_hf_model

    tiny_hf_model("qwen3").save_pretrained(tmp_path)
    platform = CountingCpuPlatform()
    runner = make_runner(platform, tmp_path)
    greedy_generate(runner, [[1, 2, 3]], 2)
    layers = 2
    # two forwards (prefill + one decode); qwen3 norms q and k per head too
    assert platform.calls["rotary_embedding"] == 2 * layers
    assert platform.calls["silu_and_mul"] == 2 * layers
    assert platform.calls["rms_norm"] == 2 * (1 + 2 * layers)  # first input norm + q/k norms
    assert platform.calls["add_rms_norm"] == 2 * (2 * layers - 1 + 1)  # the rest, incl. the final norm
