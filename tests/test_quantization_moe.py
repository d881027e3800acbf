"""Quantized checkpoints of mixtures of experts (as Qwen3-30B-A3B-FP8, Mixtral FP8 and AWQ checkpoints ship them):
each expert's projections stored quantized, per expert, beside quantized attention projections. The experts are
dequantized at load (the `fused_moe` op reads plain weights) and stacked; where the platform runs `fp8_linear`
the attention projections stay fp8 beside them. Greedy tokens equal HF's on the dequantized weights."""

from __future__ import annotations

import pytest
import torch

from omnirun.devices.cpu.platform import CpuPlatform
from omnirun.layers.linear import Linear
from omnirun.testing import greedy_generate, hf_greedy, keeping_fp8, make_runner
from quantized_checkpoints import PROMPTS, write_fp8_checkpoint, write_int4_checkpoint


@pytest.mark.parametrize(
    "arch, kind",
    [("mixtral", "fp8-block"), ("qwen2_moe", "fp8"), ("qwen3_moe", "fp8-block"), ("qwen3_moe", "awq")],
)
def test_quantized_experts_load_dequantized_and_give_hf_s_tokens(tmp_path, arch, kind):
    if kind == "awq":
        hf, stands_for = write_int4_checkpoint(tmp_path, arch, "awq", 16)
        platforms = [CpuPlatform()]
    else:
        hf, stands_for = write_fp8_checkpoint(tmp_path, arch, (16, 16) if kind == "fp8-block" else None)
        platforms = [CpuPlatform(), keeping_fp8(CpuPlatform())]
    experts = {name: weight for name, weight in stands_for.items() if ".experts." in name}
    assert experts, "the checkpoint holds no quantized expert"
    expected = [hf_greedy(hf, prompt, 8) for prompt in PROMPTS]
    for platform in platforms:
        runner = make_runner(platform, tmp_path)
        try:
            kept = [m for m in runner.model.modules() if isinstance(m, Linear) and m.fp8 is not None]
            assert bool(kept) == (platform is platforms[-1] and kind != "awq")  # attention kept where fp8 runs
            # Every expert's weight is the one its quantized parts stand for, bit for bit (greedy tokens alone would
            # miss a slightly wrong scale on one expert).
            for name, weight in experts.items():
                assert torch.equal(runner.get_weights_by_name(name), weight), name
            assert greedy_generate(runner, PROMPTS, 8) == expected
        finally:
            runner.close()
