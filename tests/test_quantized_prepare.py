"""The platform's prepared form of kept quantized weights (the op table's `prepare_fp8_linear` and
`prepare_int4_linear`): made after loading, handed to the op with every call, and made again after a weight update,
so that a vendor layout never goes stale. The test platform's ops (omnirun.testing.keeping_quantized) refuse a
`prepared` that differs from the tensors they multiply by."""

from __future__ import annotations

import pytest
import torch

from omnirun.devices.cpu.platform import CpuPlatform
from omnirun.layers import native_ops
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


def test_a_platform_offering_a_prepare_hook_without_its_op_is_told_why():
    with pytest.raises(ValueError, match=r"^a platform offering `prepare_int4_linear` must offer `int4_linear` too"):
        resolve_ops({"prepare_int4_linear": native_ops.prepare_int4_linear})
