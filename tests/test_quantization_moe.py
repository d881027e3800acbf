"""Quantized checkpoints of mixtures of experts (as Qwen3-30B-A3B-FP8, Mixtral FP8 and AWQ checkpoints ship them):
each expert's projections stored quantized, per expert, beside quantized attention projections. Where the platform
runs `fp8_fused_moe` (and `fp8_linear`) the experts (and the attention projections) stay in fp8, stacked with their
scales; where it runs `int4_fused_moe` (and `int4_linear`) AWQ/GPTQ experts stay packed; elsewhere they are
dequantized at load and stacked. Greedy tokens equal HF's on the dequantized weights."""

from __future__ import annotations

import pytest
import torch

from omnirun.devices.cpu.platform import CpuPlatform
from omnirun.errors import WeightUpdateError
from omnirun.layers.linear import Linear
from omnirun.layers.moe import SparseMoE
from omnirun.layers.native_ops import dequantize_fp8, dequantize_int4
from omnirun.testing import greedy_generate, hf_greedy, keeping_fp8, keeping_int4, make_runner
from quantized_checkpoints import (
    PROMPTS,
    prefill_logits,
    write_fp8_checkpoint,
    write_int4_checkpoint,
    write_pack_quantized_checkpoint,
)


@pytest.mark.parametrize(
    "arch, kind",
    [("mixtral", "fp8-block"), ("qwen2_moe", "fp8"), ("qwen3_moe", "fp8-block"), ("qwen3_moe", "awq")],
)
def test_quantized_experts_give_hf_s_tokens_dequantized_at_load_or_kept_in_fp8(tmp_path, arch, kind):
    block = (16, 16) if kind == "fp8-block" else None
    if kind == "awq":
        hf, stands_for = write_int4_checkpoint(tmp_path, arch, "awq", 16)
        platforms = [CpuPlatform()]
    else:
        hf, stands_for = write_fp8_checkpoint(tmp_path, arch, block)
        platforms = [CpuPlatform(), keeping_fp8(CpuPlatform())]
    experts = {name: weight for name, weight in stands_for.items() if ".experts." in name}
    assert experts, "the checkpoint holds no quantized expert"
    expected = [hf_greedy(hf, prompt, 8) for prompt in PROMPTS]
    for platform in platforms:
        keeps = platform is platforms[-1] and kind != "awq"
        runner = make_runner(platform, tmp_path)
        try:
            kept = [m for m in runner.model.modules() if isinstance(m, Linear) and m.fp8 is not None]
            assert bool(kept) == keeps  # attention kept where fp8_linear runs
            moes = [m for m in runner.model.modules() if isinstance(m, SparseMoE)]
            assert moes and all((m.fp8 is not None) == keeps for m in moes)
            # Every expert's weight is the one its quantized parts stand for, bit for bit (greedy tokens alone would
            # miss a slightly wrong scale on one expert): kept, its fp8 values times their scales.
            for name, weight in experts.items():
                held = runner.get_weights_by_name(name)
                if keeps:
                    assert held.dtype == torch.float8_e4m3fn, name
                    scale = runner.get_weights_by_name(name.removesuffix("weight") + "weight_scale")
                    held = dequantize_fp8(held, scale, block)
                assert torch.equal(held, weight), name
            assert greedy_generate(runner, PROMPTS, 8) == expected
            if keeps:
                assert platform.calls["fp8_fused_moe"] > 0
                assert "in fp8, fp8_fused_moe" in runner.describe()["experts"]
        finally:
            runner.close()


def test_fp8_experts_whose_blocks_straddle_gate_and_up_are_dequantized_at_load(tmp_path):
    """qwen3_moe's experts have 32 intermediate columns: in blocks of 24 rows gate's last block is partial, so the
    stacked gate|up rows share no block grid; the experts are dequantized, the attention projections stay fp8."""
    hf, _ = write_fp8_checkpoint(tmp_path, "qwen3_moe", (24, 16))
    runner = make_runner(keeping_fp8(CpuPlatform()), tmp_path)
    try:
        assert all(m.fp8 is None for m in runner.model.modules() if isinstance(m, SparseMoE))
        assert any(isinstance(m, Linear) and m.fp8 is not None for m in runner.model.modules())
        assert greedy_generate(runner, PROMPTS, 8) == [hf_greedy(hf, prompt, 8) for prompt in PROMPTS]
    finally:
        runner.close()


def test_omnirun_env_says_where_fp8_experts_stay_fp8():
    from omnirun.env_report import platform_row

    assert "fp8 experts kept in fp8 for fp8_fused_moe" in platform_row(keeping_fp8(CpuPlatform())).quantized
    assert "fp8_fused_moe" not in platform_row(CpuPlatform()).quantized


@pytest.mark.parametrize(
    "arch, method, group_size",
    [("qwen3_moe", "awq", 16), ("mixtral", "gptq", 32), ("qwen2_moe", "gptq", 16), ("qwen3_moe", "pack-quantized", 16)],
)
def test_int4_experts_kept_packed_give_the_dequantized_model_s_logits(tmp_path, arch, method, group_size):
    """Where the platform runs `int4_fused_moe`, each expert's packed words, scales and zero points are stacked as
    loaded (every expert projection dequantizes to the weight its parts stand for, bit for bit), the op runs them,
    and the logits equal the dequantized model's bit for bit in float32 (the reference op dequantizes as a load
    does); greedy tokens equal HF's."""
    if method == "pack-quantized":  # compressed-tensors' W4A16, asymmetric
        hf, stands_for = write_pack_quantized_checkpoint(tmp_path, arch, 4, group_size, symmetric=False)
    else:
        hf, stands_for = write_int4_checkpoint(tmp_path, arch, method, group_size)
    platform = keeping_int4(CpuPlatform())
    kept, dequantized = make_runner(platform, tmp_path), make_runner(CpuPlatform(), tmp_path)
    try:
        moes = [m for m in kept.model.modules() if isinstance(m, SparseMoE)]
        assert moes and all(m.int4 is not None and not hasattr(m, "w13") for m in moes)
        assert all(m.int4 is None for m in dequantized.model.modules() if isinstance(m, SparseMoE))
        experts = {name: weight for name, weight in stands_for.items() if ".experts." in name}
        assert experts, "the checkpoint holds no quantized expert"
        for name, weight in experts.items():
            layer = name.removesuffix(".weight")
            parts = [
                kept.get_weights_by_name(f"{layer}.{p}") for p in ("weight_packed", "weight_scale", "weight_zero_point")
            ]
            assert torch.equal(dequantize_int4(*parts, group_size), weight), name
        with pytest.raises(WeightUpdateError, match=r"^[^\n]*weight_packed"):  # not stored: names what to read
            kept.get_weights_by_name(next(iter(experts)))
        assert "packed in int4, int4_fused_moe" in kept.describe()["experts"]
        calls = platform.calls["int4_fused_moe"]
        logits = prefill_logits(kept)
        assert platform.calls["int4_fused_moe"] > calls
        assert torch.equal(logits, prefill_logits(dequantized))
        assert greedy_generate(kept, PROMPTS, 8) == [hf_greedy(hf, prompt, 8) for prompt in PROMPTS]
    finally:
        kept.close()
        dequantized.close()


def test_omnirun_env_says_where_int4_experts_stay_packed():
    from omnirun.env_report import platform_row

    assert (
        "awq/gptq/w4a16 4-bit experts kept packed for int4_fused_moe"
        in platform_row(keeping_int4(CpuPlatform())).quantized
    )
    assert "int4_fused_moe" not in platform_row(CpuPlatform()).quantized


@pytest.mark.parametrize(
    "full, start, size, group, span",
    [
        (1536, 192, 192, 128, (64, 256)),  # Qwen3-235B-A22B-AWQ at TP 8, rank 1: inputs 128-383, its own 192-383
        (1536, 0, 192, 128, (0, 256)),  # rank 0: 0-255, its own 0-191
        (1536, 1344, 192, 128, (64, 192 + 64)),  # rank 7: 1,280-1,535, to the projection's end
        (768, 384, 384, 128, (0, 384)),  # Qwen3-30B-A3B-AWQ at TP 2: whole groups
        (768, 0, 768, -1, (0, 768)),  # one group over all the inputs, whole
        (768, 192, 192, -1, None),  # one group over all the inputs, cut: dequantized at load
        (96, 12, 12, 16, None),  # a cut word of eight inputs: dequantized at load
    ],
)
def test_int4_experts_widen_a_rank_s_columns_to_whole_groups(full, start, size, group, span):
    """A rank whose share of each expert's columns cuts the down projection's groups keeps the experts packed, its
    columns widened to the groups they lie in (SparseMoE._int4_span: the columns before its first and after its last,
    zeros); words cut, or the one group of group size -1 cut, dequantize at load."""
    from omnirun.distributed.tensor_parallel import TensorParallel
    from omnirun.layers.linear import Int4Weights
    from omnirun.layers.ops import resolve_ops
    from omnirun.layers.sharding import Slice

    ops = resolve_ops(keeping_int4(CpuPlatform()).fused_ops())
    with torch.device("meta"):
        moe = SparseMoE(64, 4, range(4), 2, True, Slice(full, start, size), ops=ops, dtype=torch.float32,
                        tp=TensorParallel.single(), quantized=Int4Weights(group))  # fmt: skip
    if span is None:
        assert moe.int4 is None and moe.w2.shape == (4, 64, size)
        return
    lead, padded = span
    assert moe.int4 is not None and moe.lead == lead
    assert moe.w13_packed.shape == (4, 2 * padded, 64 // 8) and moe.w2_packed.shape == (4, 64, padded // 8)
    groups = 1 if group == -1 else padded // group
    assert moe.w2_scale.shape == moe.w2_zero_point.shape == (4, 64, groups)
    down = moe.expert_target(0, "down", "weight_packed")
    assert (down.start, down.length) == (start // 8, size // 8) or (start, size) == (0, full)
    scales = moe.expert_target(0, "down", "weight_scale")
    if group != -1:
        assert (scales.start, scales.length) == ((start - lead) // group, groups) or groups == full // group
    gate, up = moe.expert_target(0, "gate", "weight_packed"), moe.expert_target(0, "up", "weight_packed")
    words = 64 // 8  # a row of gate|up: the hidden size in words
    assert gate.view.storage_offset() == lead * words and up.view.storage_offset() == (padded + lead) * words


@pytest.mark.parametrize(
    "full, start, size, block, span",
    [
        (1536, 192, 192, (128, 128), (64, 256)),  # Qwen3-235B-A22B-FP8 at TP 8, rank 1: columns 128-383
        (1536, 1344, 192, (128, 128), (64, 256)),  # rank 7, to the projection's end
        (768, 192, 192, (128, 128), (64, 256)),  # Qwen3-30B-A3B-FP8 at TP 4, rank 1
        (96, 0, 96, (32, 64), (0, 96)),  # whole blocks of rows; the last column block partial, at the end
        (48, 0, 48, (32, 32), None),  # whole, but gate's last block of rows would hold up's first: dequantized
        (768, 0, 768, None, (0, 768)),  # per-row scales: never widened
    ],
)
def test_fp8_experts_widen_a_rank_s_columns_to_whole_blocks(full, start, size, block, span):
    """A rank whose share of each expert's columns cuts the fp8 blocks keeps the experts in fp8, its columns widened
    to whole blocks of rows and columns (SparseMoE._fp8_span, zeros outside its own)."""
    from omnirun.distributed.tensor_parallel import TensorParallel
    from omnirun.layers.linear import Fp8Weights
    from omnirun.layers.ops import resolve_ops
    from omnirun.layers.sharding import Slice

    ops = resolve_ops(keeping_fp8(CpuPlatform()).fused_ops())
    with torch.device("meta"):
        moe = SparseMoE(64, 4, range(4), 2, True, Slice(full, start, size), ops=ops, dtype=torch.float32,
                        tp=TensorParallel.single(), quantized=Fp8Weights(block))  # fmt: skip
    if span is None:
        assert moe.fp8 is None and moe.w2.dtype == torch.float32
        return
    lead, padded = span
    assert moe.fp8 is not None and moe.lead == lead
    assert moe.w13.shape == (4, 2 * padded, 64) and moe.w2.shape == (4, 64, padded)
    gate, up = moe.expert_target(0, "gate"), moe.expert_target(0, "up")
    assert gate.view.storage_offset() == lead * 64 and up.view.storage_offset() == (padded + lead) * 64
    if block is not None:
        rows, cols = block
        assert moe.w13_scale.shape == (4, 2 * padded // rows, -(-64 // cols))
        assert moe.w2_scale.shape == (4, -(-64 // rows), -(-padded // cols))
        scale = moe.expert_target(0, "up", "weight_scale")
        assert scale.view.storage_offset() == padded // rows  # up's blocks after gate's
