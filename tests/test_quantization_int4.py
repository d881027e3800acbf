"""int4 checkpoints, AWQ (GEMM) and GPTQ (with and without act order), written by a helper from AutoAWQ's and
AutoGPTQ's packing and loaded by dequantizing once at load: every loaded weight equals what the checkpoint stands
for, bit for bit, and greedy tokens equal HF transformers on those weights (float32)."""

from __future__ import annotations

import pytest
import torch

from omnirun.errors import ModelLoadError, WeightUpdateError
from omnirun.quantization import dequantized, quantized_format
from omnirun.quantization.int4 import AWQ_ORDER, unpack
from omnirun.registry import select_platform
from omnirun.testing import make_runner, tiny_hf_model
from quantized_checkpoints import AWQ_PACK_ORDER, assert_loads_as, write_int4_checkpoint


@pytest.mark.parametrize(
    "arch, method, group_size, act_order, described",
    [
        ("llama", "awq", 32, False, "awq int4 group 32"),
        ("qwen2", "gptq", 16, False, "gptq int4 group 16"),
        ("qwen3", "gptq", 32, True, "gptq int4 group 32"),
    ],
    ids=["awq", "gptq", "gptq-act-order"],
)
def test_weights_and_greedy_tokens_equal_hf_on_the_dequantized_checkpoint(
    tmp_path, arch, method, group_size, act_order, described
):
    hf, stands_for = write_int4_checkpoint(tmp_path, arch, method, group_size, act_order)
    assert_loads_as(tmp_path, hf, stands_for, described)


def test_the_reader_s_awq_order_is_the_inverse_of_autoawq_s_packing():
    columns = torch.arange(8, dtype=torch.int32).unsqueeze(0)  # one row, values = column index
    word = sum(int(columns[0, AWQ_PACK_ORDER[i]]) << (4 * i) for i in range(8))
    packed = torch.tensor([[word - 2**32 if word >= 2**31 else word]], dtype=torch.int32)
    assert unpack(packed, 4, dim=1, order=AWQ_ORDER).tolist() == columns.tolist()


class _Config:
    def __init__(self, quantization: dict):
        self.quantization_config = quantization


@pytest.mark.parametrize(
    "quantization, message",
    [
        ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "version 'gemv'"),
        ({"quant_method": "awq", "bits": 3}, "AWQ with bits 3"),
        ({"quant_method": "gptq", "bits": 3}, "GPTQ with bits 3 is not supported"),
        ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 0}, "group_size 0 is invalid"),
    ],
)
def test_unsupported_int4_configs_are_refused_in_one_line(quantization, message):
    with pytest.raises(ModelLoadError, match="^[^\n]*$") as caught:
        quantized_format(_Config(quantization))
    assert message in str(caught.value)


def test_a_layer_without_its_zero_points_is_refused():
    fmt = quantized_format(_Config({"quant_method": "awq", "bits": 4, "group_size": 8}))
    stream = [("a.qweight", torch.zeros(8, 1, dtype=torch.int32)), ("a.scales", torch.ones(1, 8))]
    with pytest.raises(ModelLoadError, match="has a.qweight but no a.qzeros"):
        list(dequantized(iter(stream), fmt, torch.float32))


def test_scales_of_the_wrong_group_count_are_refused():
    fmt = quantized_format(_Config({"quant_method": "awq", "bits": 4, "group_size": 4}))
    stream = [
        ("a.qweight", torch.zeros(8, 1, dtype=torch.int32)),
        ("a.qzeros", torch.zeros(1, 1, dtype=torch.int32)),
        ("a.scales", torch.ones(1, 8)),
    ]
    with pytest.raises(ModelLoadError, match="8 inputs in groups of 4 needs 2 groups of scales, the checkpoint has 1"):
        list(dequantized(iter(stream), fmt, torch.float32))


def test_a_weight_update_from_a_quantized_checkpoint_is_refused_and_changes_nothing(tmp_path):
    tiny_hf_model("llama").save_pretrained(tmp_path / "plain")
    write_int4_checkpoint(tmp_path / "awq", "llama", "awq", 32)
    runner = make_runner(select_platform("cpu"), tmp_path / "plain")
    try:
        name = "model.layers.0.mlp.down_proj.weight"
        before = runner.get_weights_by_name(name)
        with pytest.raises(WeightUpdateError, match="takes unquantized checkpoints, and .* is awq int4 group 32"):
            runner.update_weights_from_disk(str(tmp_path / "awq"))
        assert torch.equal(runner.get_weights_by_name(name), before)
    finally:
        runner.close()
