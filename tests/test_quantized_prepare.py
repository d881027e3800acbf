"""The platform's prepared form of kept quantized weights (the op table's `prepare_fp8_linear`,
`prepare_int4_linear` and `prepare_int4_fused_moe`): made after loading, handed to the op with every call, and made
again after a weight update, so that a vendor layout never goes stale. The test platform's ops
(omnirun.testing.keeping_quantized) refuse a `prepared` that differs from the tensors they multiply by."""

from __future__ import annotations

import pytest
import torch

from omnirun.devices.cpu.platform import CpuPlatform
from omnirun.layers import native_ops
from omnirun.layers.moe import SparseMoE
from omnirun.layers.ops import resolve_ops
from omnirun.testing import keeping_fp8, keeping_int4, make_runner, replayed_and_eager
from omnirun_fakes.graph_cpu import GraphCpu, GraphTorchNative
from quantized_checkpoints import prefill_logits, write_fp8_checkpoint, write_int4_checkpoint


@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_a_weight_update_of_a_kept_layer_is_prepared_again_before_the_next_step(tmp_path, fmt):
    if fmt == "fp8":
        write_fp8_checkpoint(tmp_path, "llama", (16, 16))
        runner = make_runner(keeping_fp8(CpuPlatform()), tmp_path)
    else:
        write_int4_checkpoint(tmp_path, "llama", "awq", 16)
        runner = make_runner(keeping_int4(CpuPlatform()), tmp_path)
    try:
        layer = runner.model.model.layers[0].mlp.down_proj
        assert layer.prepared is not None and torch.equal(layer.prepared[1], layer.weight_scale)
        before = prefill_logits(runner)
        name = "model.layers.0.mlp.down_proj.weight_scale"
        runner.update_weights_from_tensor([(name, runner.get_weights_by_name(name) * 2)])
        assert torch.equal(layer.prepared[1], layer.weight_scale)  # the op would refuse a stale form
        assert not torch.equal(prefill_logits(runner), before)
    finally:
        runner.close()


def test_a_weight_update_of_kept_4_bit_experts_is_prepared_again_before_the_next_step(tmp_path):
    write_int4_checkpoint(tmp_path, "qwen3_moe", "awq", 16)
    runner = make_runner(keeping_int4(CpuPlatform()), tmp_path)
    try:
        layers = runner.model.model.layers
        index, moe = next((i, layer.mlp) for i, layer in enumerate(layers) if isinstance(layer.mlp, SparseMoE))
        assert moe.prepared is not None and torch.equal(moe.prepared[4], moe.w2_scale)
        before = prefill_logits(runner)
        name = f"model.layers.{index}.mlp.experts.1.down_proj.weight_scale"
        runner.update_weights_from_tensor([(name, runner.get_weights_by_name(name) * 2)])
        assert torch.equal(moe.prepared[4], moe.w2_scale)  # the op would refuse a stale form
        assert not torch.equal(prefill_logits(runner), before)
    finally:
        runner.close()


class ComputesFromItsForm(GraphCpu):
    """Recorded decode graphs, and an `int4_linear` that multiplies by its prepared form alone (the dequantized
    weight), as a vendor's kernel reads its own re-laid weight: a captured graph holds the form's memory. With
    `host_number` the form also carries a number computed from the weights (as Ascend's form says whether every zero
    point is 8), so an update changes the form's structure and it cannot be refreshed in place."""

    def __init__(self, host_number: bool):
        super().__init__()
        self.host_number = host_number

    def device_fused_ops(self):
        def prepare(weight_packed, weight_scale, weight_zero_point, group_size):
            weight = native_ops.dequantize_int4(weight_packed, weight_scale, weight_zero_point, group_size)
            return (weight, float(weight_scale.max())) if self.host_number else (weight,)

        def int4_linear(x, weight_packed, weight_scale, weight_zero_point, bias, group_size, prepared):
            return torch.nn.functional.linear(x, prepared[0].to(x.dtype), bias)

        return {**super().device_fused_ops(), "int4_linear": int4_linear, "prepare_int4_linear": prepare}


@pytest.mark.parametrize("host_number", [False, True], ids=["refreshed-in-place", "captured-again"])
def test_a_weight_update_reaches_the_decode_graphs_that_read_a_prepared_form(tmp_path, host_number):
    write_int4_checkpoint(tmp_path, "llama", "awq", 16)
    runner = make_runner(
        ComputesFromItsForm(host_number), tmp_path, attention_backend=GraphTorchNative.name, max_running_requests=4
    )
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
    try:
        assert runner.graph_runner is not None and runner.graph_runner.graphs
        layer = runner.model.model.layers[0].mlp.down_proj
        form = layer.prepared[0]
        _, before = replayed_and_eager(runner, prompts)
        name = "model.layers.0.mlp.down_proj.weight_scale"
        runner.update_weights_from_tensor([(name, runner.get_weights_by_name(name) * 2)])
        replayed, eager = replayed_and_eager(runner, prompts)
        assert (eager - before).abs().max() > 1e-2  # the update changed the step
        torch.testing.assert_close(replayed, eager, atol=1e-5, rtol=1e-5)  # and the graphs see it
        assert (layer.prepared[0] is form) != host_number  # the captured memory, refreshed, unless re-made
    finally:
        runner.close()


def test_a_platform_offering_a_prepare_hook_without_its_op_is_told_why():
    with pytest.raises(ValueError, match=r"^a platform offering `prepare_int4_linear` must offer `int4_linear` too"):
        resolve_ops({"prepare_int4_linear": native_ops.prepare_int4_linear})
    with pytest.raises(ValueError, match=r"^a platform offering `prepare_int4_fused_moe` must offer `int4_fused_moe`"):
        resolve_ops({"prepare_int4_fused_moe": native_ops.prepare_int4_fused_moe})


def test_a_layer_the_platform_s_op_does_not_take_is_dequantized_at_load(tmp_path):
    """`int4_linear_takes` declines the down projections (K = the MLP's width): they load dequantized, the rest stay
    packed, and the logits are the dequantized model's."""
    write_int4_checkpoint(tmp_path, "llama", "awq", 16)
    base = keeping_int4(CpuPlatform())
    width = 64  # the tiny models' hidden size: every projection but down_proj reads it

    class DeclinesWideInputs(type(base)):
        def device_fused_ops(self):
            return {**super().device_fused_ops(), "int4_linear_takes": lambda n, k, group, dtype: k == width}

    kept, plain = make_runner(DeclinesWideInputs(), tmp_path), make_runner(CpuPlatform(), tmp_path)
    try:
        layers = kept.model.model.layers
        assert all(
            layer.mlp.down_proj.int4 is None and layer.mlp.down_proj.weight.dtype == torch.float32 for layer in layers
        )
        assert all(layer.self_attn.qkv_proj.int4 is not None for layer in layers)
        assert "6 linear layers kept in int4" in kept.describe()["weights"]
        assert torch.equal(prefill_logits(kept), prefill_logits(plain))
    finally:
        kept.close()
        plain.close()
