"""fp8 checkpoints on a platform that runs `fp8_linear`: the linear layers keep the checkpoint's fp8 weights and
scales (per row, per-tensor scales repeated per row, or per block) instead of dequantizing them at load, and give
the logits of the dequantized model. Here the platform offers the reference op as its kernel
(`omnirun.testing.keeping_fp8`); the kernels themselves are checked against it in tests/kernels and on their lanes."""

from __future__ import annotations

import pytest
import torch

from omnirun.devices.cpu.platform import CpuPlatform
from omnirun.layers.linear import Linear
from omnirun.testing import greedy_generate, hf_greedy, keeping_fp8, make_runner
from quantized_checkpoints import PROMPTS, prefill_logits, write_fp8_checkpoint


@pytest.mark.parametrize(
    "arch, block, keep",
    [
        ("llama", (16, 32), ("layers.1.mlp.down_proj",)),  # blocks that the q/k/v and gate/up shards fill whole
        ("qwen3", None, ()),  # per-tensor scales: q, k and v each keep their own in the fused layer
        ("qwen2", "channel", ("layers.0.self_attn.o_proj",)),  # compressed-tensors per channel, qkv bias
        ("llama", (24, 40), ()),  # blocks that cut q|k|v and gate|up: those two dequantized at load, o and down kept
    ],
    ids=["block", "per-tensor", "compressed-tensors-channel", "block-cut"],
)
def test_kept_fp8_layers_give_the_dequantized_model_s_logits(tmp_path, arch, block, keep):
    hf, _ = write_fp8_checkpoint(tmp_path, arch, block, keep)
    platform = keeping_fp8(CpuPlatform())
    kept, dequantized = make_runner(platform, tmp_path), make_runner(CpuPlatform(), tmp_path)
    try:
        linears = [m for m in kept.model.modules() if isinstance(m, Linear) and m.fp8 is not None]
        expected = {(16, 32): 7, None: 8, "channel": 7, (24, 40): 4}[block]  # 4 a layer, less those left out
        assert len(linears) == expected
        for linear in linears:
            assert linear.weight.dtype == torch.float8_e4m3fn and linear.weight_scale.dtype == torch.float32
        assert f"{expected} linear layers kept in fp8" in kept.describe()["weights"]
        assert "dequantized" in dequantized.describe()["weights"]
        calls = platform.calls["fp8_linear"]
        logits = prefill_logits(kept)
        assert platform.calls["fp8_linear"] > calls  # the layers ran through the op
        # The reference op multiplies by the weight dequantized as at load: the same float32 logits, bit for bit.
        assert torch.equal(logits, prefill_logits(dequantized))
        assert greedy_generate(kept, PROMPTS, 8) == [hf_greedy(hf, prompt, 8) for prompt in PROMPTS]
    finally:
        kept.close()
        dequantized.close()


def test_a_full_precision_weight_for_a_layer_the_config_quantizes_is_refused_in_one_line(tmp_path):
    """A layer left unquantized in the checkpoint but not named in the config's ignore list."""
    import json

    write_fp8_checkpoint(tmp_path, "llama", (16, 32), ("layers.1.mlp.down_proj",))
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"]["modules_to_not_convert"] = ["lm_head"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    from omnirun.errors import ModelLoadError

    with pytest.raises(
        ModelLoadError,
        match=r"down_proj\.weight. is stored as float32, but its layer keeps the fp8 weights.*modules_to_not_convert",
    ):
        make_runner(keeping_fp8(CpuPlatform()), tmp_path)
