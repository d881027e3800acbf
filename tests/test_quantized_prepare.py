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
from omnirun.testing import keeping_fp8, keeping_int4, make_runner
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
