"""fp8 checkpoints (`quant_method: "fp8"` block-wise and per-tensor; compressed-tensors' float-quantized per
channel), written by a helper from the published layouts and loaded by dequantizing once at load: greedy tokens
equal HF transformers run on the dequantized weights (float32, exact), and a bad checkpoint is refused in one
line."""

from __future__ import annotations

import json

import pytest
import torch

from omnirun.errors import ModelLoadError
from omnirun.quantization import dequantized, quantized_format
from omnirun.registry import select_platform
from omnirun.testing import make_runner, tiny_hf_model
from quantized_checkpoints import assert_loads_as, dequantize_fp8, quantize_fp8, write_fp8_checkpoint


@pytest.mark.parametrize(
    "arch, block, keep, static",
    [
        ("llama", (24, 40), ("layers.1.mlp.down_proj",), False),  # partial, non-square blocks; one layer kept
        ("qwen3", None, (), True),  # per-tensor scales, static activation scales, tied embeddings
        ("qwen2", "channel", ("layers.0.self_attn.o_proj",), True),  # compressed-tensors, KV scales, qkv bias
    ],
    ids=["block", "per-tensor", "compressed-tensors-channel"],
)
def test_weights_and_greedy_tokens_equal_hf_on_the_dequantized_checkpoint(tmp_path, arch, block, keep, static):
    hf, dequantized_weights = write_fp8_checkpoint(tmp_path, arch, block, keep, static)
    described = {None: "fp8 per-tensor", "channel": "compressed-tensors fp8 per-channel"}.get(
        block, "fp8 block [24, 40]"
    )
    assert_loads_as(tmp_path, hf, dequantized_weights, described)


def test_scales_before_their_weights_and_other_tensors_pass_through():
    fmt = quantized_format(_Config({"quant_method": "fp8", "weight_block_size": [2, 2]}))
    q, scale = quantize_fp8(torch.randn(3, 5), (2, 2))
    stream = [("a.weight_scale_inv", scale), ("norm.weight", torch.ones(4)), ("a.weight", q)]
    out = dict(dequantized(iter(stream), fmt, torch.float32))
    assert list(out) == ["norm.weight", "a.weight"]
    assert torch.equal(out["a.weight"], dequantize_fp8(q, scale, (2, 2)))


def test_the_parts_of_a_layer_another_rank_holds_are_never_read():
    """Expert parallelism: another rank's expert is dropped from the stream unread (each rank would otherwise read
    and dequantize every expert of the checkpoint)."""

    class Unreadable:  # a lazy checkpoint tensor that must stay unread
        dtype, shape = torch.float8_e4m3fn, (3, 5)

        def read(self, index=None):
            raise AssertionError("read a tensor of a layer held elsewhere")

    fmt = quantized_format(_Config({"quant_method": "fp8", "weight_block_size": [2, 2]}))
    q, scale = quantize_fp8(torch.randn(3, 5), (2, 2))
    stream = [("e1.weight", Unreadable()), ("e0.weight", q), ("e0.weight_scale_inv", scale)]
    stream.append(("e1.weight_scale_inv", Unreadable()))
    out = dict(dequantized(iter(stream), fmt, torch.float32, elsewhere=lambda layer: layer == "e1"))
    assert list(out) == ["e0.weight"]


class _Config:
    def __init__(self, quantization: dict):
        self.quantization_config = quantization


@pytest.mark.parametrize(
    "quantization, stream, message",
    [
        (
            {"quant_method": "bitsandbytes"},
            [],
            "'bitsandbytes', which omnirun cannot load yet (supported: fp8, compressed-tensors, awq, gptq)",
        ),
        ({"quant_method": "fp8", "fmt": "e5m2"}, [], "fmt 'e5m2' are not supported"),
        ({"quant_method": "fp8", "weight_block_size": [128]}, [], "weight_block_size [128] is invalid"),
        (
            {"quant_method": "fp8", "weight_block_size": [2, 2]},
            [("a.weight", torch.zeros(4, 4, dtype=torch.float8_e4m3fn))],
            "has a.weight but no a.weight_scale_inv",
        ),
        (
            {"quant_method": "fp8", "weight_block_size": [2, 2]},
            [("a.weight_scale_inv", torch.ones(1, 1))],
            "has a.weight_scale_inv but no a.weight",
        ),
        (
            {"quant_method": "fp8", "weight_block_size": [2, 2]},
            [("a.weight", torch.zeros(4, 4, dtype=torch.float8_e4m3fn)), ("a.weight_scale_inv", torch.ones(1, 1))],
            "needs weight_scale_inv of shape [2, 2], got [1, 1]",
        ),
        (
            {"quant_method": "fp8"},
            [("a.weight", torch.zeros(4, 4, dtype=torch.float8_e4m3fn)), ("a.weight_scale", torch.ones(2))],
            "a per-tensor fp8 weight_scale holds one value",
        ),
        (
            {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "config_groups": {"g": {}}},
            [],
            "compressed-tensors format nvfp4-pack-quantized is not supported yet",
        ),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "float-quantized",
                "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int", "strategy": "group"}}},
            },
            [],
            "has 4-bit int weights: omnirun loads 8-bit float weights only",
        ),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "float-quantized",
                "config_groups": {"g": {"weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}},
            },
            [("a.weight", torch.zeros(4, 4, dtype=torch.float8_e4m3fn)), ("a.weight_scale", torch.ones(3, 1))],
            "a per-channel fp8 weight of 4 rows needs 4 scales, got shape [3, 1]",
        ),
    ],
)
def test_bad_checkpoints_are_refused_in_one_line(quantization, stream, message):
    with pytest.raises(ModelLoadError, match="^[^\n]*$") as caught:  # the format and the stream both checked
        list(dequantized(iter(stream), quantized_format(_Config(quantization)), torch.float32))
    assert message in str(caught.value)


def test_an_unknown_method_is_refused_before_any_weight_is_read(tmp_path):
    tiny_hf_model("llama").save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "hqq", "nbits": 4}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes(b"not read")
    with pytest.raises(ModelLoadError, match="quant_method 'hqq', which omnirun cannot load yet"):
        make_runner(select_platform("cpu"), tmp_path)
