"""compressed-tensors integer checkpoints, pack-quantized (llm-compressor's W4A16 and W8A16) and int-quantized (its
W8A8), written by a helper from compressed-tensors' layouts and loaded by dequantizing once at load: every loaded
weight equals what the checkpoint stands for, bit for bit, and greedy tokens equal HF transformers on those weights
(float32)."""

from __future__ import annotations

import pytest
import torch

from omnirun.errors import ModelLoadError
from omnirun.quantization import dequantized, quantized_format
from quantized_checkpoints import _pack_signed, assert_loads_as, write_pack_quantized_checkpoint


@pytest.mark.parametrize(
    "arch, bits, group_size, symmetric, actorder, packed, described",
    [
        ("llama", 4, 16, True, False, True, "compressed-tensors int4 group 16"),
        ("qwen2", 4, 32, False, False, True, "compressed-tensors int4 group 32 asymmetric"),
        ("qwen3", 4, 16, True, True, True, "compressed-tensors int4 group 16"),
        ("mistral", 8, None, True, False, True, "compressed-tensors int8 per channel"),
        ("llama", 8, None, True, False, False, "compressed-tensors int8 per channel (int-quantized)"),
        ("qwen2", 8, None, False, False, False, "compressed-tensors int8 per channel asymmetric (int-quantized)"),
    ],
    ids=["w4a16", "w4a16-asymmetric", "w4a16-actorder", "w8a16-channel", "w8a8", "w8a8-asymmetric"],
)
def test_weights_and_greedy_tokens_equal_hf_on_the_dequantized_checkpoint(
    tmp_path, arch, bits, group_size, symmetric, actorder, packed, described
):
    hf, stands_for = write_pack_quantized_checkpoint(tmp_path, arch, bits, group_size, symmetric, actorder, packed)
    assert_loads_as(tmp_path, hf, stands_for, described)


def test_a_swapped_pair_of_nibbles_changes_the_weight():
    """The reader's nibble order is the writer's: packing with two fields swapped must not load the same weight."""
    fmt = quantized_format(_config(4, 8, True))
    q = torch.arange(-8, 8).reshape(1, 16)
    scale = torch.ones(1, 2)
    parts = [_pack_signed(q, 4, dim=1), scale, torch.tensor([1, 16])]
    assert fmt.dequantize(parts, torch.float32).tolist() == q.float().tolist()
    swapped = q[:, [1, 0, *range(2, 16)]]
    assert fmt.dequantize([_pack_signed(swapped, 4, dim=1), scale, torch.tensor([1, 16])], torch.float32).tolist() != (
        q.float().tolist()
    )


class _Config:
    def __init__(self, quantization: dict):
        self.quantization_config = quantization


def _config(bits, group_size, symmetric, **weights):
    weights = {"num_bits": bits, "type": "int", "strategy": "group", "group_size": group_size, **weights}
    weights["symmetric"] = symmetric
    return _Config(
        {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {"weights": weights}}}
    )


@pytest.mark.parametrize(
    "config, stream, message",
    [
        (_config(3, 8, True), [], "packs 3-bit int weights"),
        (_config(4, 8, True, strategy="tensor"), [], "int weight strategy 'tensor'"),
        (_config(4, 0, True), [], "group_size 0"),
        (
            _Config(
                {
                    "quant_method": "compressed-tensors",
                    "format": "pack-quantized",
                    "config_groups": {
                        "g": {
                            "weights": {"num_bits": 4, "type": "int", "strategy": "channel"},
                            "input_activations": {"num_bits": 8, "type": "int", "dynamic": True},
                        }
                    },
                }
            ),
            [],
            "quantizes its input activations",
        ),
        (
            _config(4, 8, True),
            [
                ("a.weight_packed", torch.zeros(2, 2, dtype=torch.int32)),
                ("a.weight_scale", torch.ones(2, 3)),
                ("a.weight_shape", torch.tensor([2, 16])),
            ],
            "has 3 groups of scales",
        ),
        (
            _config(4, 8, True),
            [
                ("a.weight_packed", torch.zeros(2, 2, dtype=torch.int32)),
                ("a.weight_scale", torch.ones(3, 2)),
                ("a.weight_shape", torch.tensor([2, 16])),
            ],
            "compressed-tensors int parts disagree",
        ),
    ],
)
def test_bad_pack_quantized_checkpoints_are_refused_in_one_line(config, stream, message):
    with pytest.raises(ModelLoadError, match="^[^\n]*$") as caught:
        list(dequantized(iter(stream), quantized_format(config), torch.float32))
    assert message in str(caught.value)


def test_an_int_quantized_weight_with_one_scale_and_zero_point_for_the_tensor():
    weights = {"num_bits": 8, "type": "int", "strategy": "tensor", "symmetric": False}
    fmt = quantized_format(
        _Config(
            {
                "quant_method": "compressed-tensors",
                "format": "int-quantized",
                "config_groups": {"g": {"weights": weights}},
            }
        )
    )
    q = torch.tensor([[-3, 0, 7], [127, -128, 1]], dtype=torch.int8)
    got = fmt.dequantize([q, torch.tensor([0.5]), torch.tensor([2], dtype=torch.int8)], torch.float32)
    assert got.tolist() == ((q.float() - 2) * 0.5).tolist()
    assert fmt.layer_of("a.weight", torch.int8) == "a" and fmt.layer_of("lm_head.weight", torch.bfloat16) is None
