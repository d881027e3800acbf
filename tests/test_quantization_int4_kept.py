"""AWQ, GPTQ and compressed-tensors pack-quantized 4-bit checkpoints on a platform that runs `int4_linear`: the
linear layers keep the packed weights (converted at load to one layout: int32 [N, K / 8], float32 scales and uint8
zero points [N, groups]) instead of dequantizing them, and give the dequantized model's logits bit for bit in
float32 and HF's greedy tokens. Here the platform offers the reference op as its kernel
(`omnirun.testing.keeping_int4`); the Triton kernels are checked against it in tests/kernels/test_triton_int4_linear.py
and on the cuda lane."""

from __future__ import annotations

import json

import pytest
import torch

from omnirun.devices.cpu.platform import CpuPlatform
from omnirun.errors import ModelLoadError, WeightUpdateError
from omnirun.layers.linear import Linear
from omnirun.testing import greedy_generate, hf_greedy, keeping_int4, make_runner
from quantized_checkpoints import PROMPTS, prefill_logits, write_int4_checkpoint, write_pack_quantized_checkpoint


@pytest.mark.parametrize(
    "arch, method, group_size, act_order, symmetric, keep, expected",
    [
        ("llama", "awq", 16, False, False, ("layers.1.mlp.down_proj",), 7),  # one layer left unquantized
        ("qwen2", "gptq", 16, False, True, (), 8),  # sym (zero 8), the fused q|k|v with its bias
        ("qwen3", "gptq", 32, False, False, ("layers.0.self_attn.o_proj",), 7),  # asym
        ("llama", "gptq", 32, True, False, (), 0),  # act order: dequantized at load
    ],
    ids=["awq", "gptq-sym", "gptq-asym", "gptq-act-order"],
)
def test_kept_int4_layers_give_the_dequantized_model_s_logits(
    tmp_path, arch, method, group_size, act_order, symmetric, keep, expected
):
    hf, _ = write_int4_checkpoint(tmp_path, arch, method, group_size, act_order, symmetric=symmetric, keep=keep)
    platform = keeping_int4(CpuPlatform())
    kept, dequantized = make_runner(platform, tmp_path), make_runner(CpuPlatform(), tmp_path)
    try:
        linears = [m for m in kept.model.modules() if isinstance(m, Linear) and m.int4 is not None]
        assert len(linears) == expected
        for linear in linears:
            assert linear.weight_packed.dtype == torch.int32 and linear.weight_zero_point.dtype == torch.uint8
            assert linear.weight_packed.shape[1] * 8 == linear.in_features and not hasattr(linear, "weight")
        described = kept.describe()["weights"]
        assert (f"{expected} linear layers kept in int4" in described) == bool(expected), described
        assert "dequantized" in dequantized.describe()["weights"]
        calls = platform.calls["int4_linear"]
        logits = prefill_logits(kept)
        assert (platform.calls["int4_linear"] > calls) == bool(expected)  # the kept layers ran through the op
        # The reference op multiplies by the weight dequantized as at load: the same float32 logits, bit for bit.
        assert torch.equal(logits, prefill_logits(dequantized))
        assert greedy_generate(kept, PROMPTS, 8) == [hf_greedy(hf, prompt, 8) for prompt in PROMPTS]
    finally:
        kept.close()
        dequantized.close()


@pytest.mark.parametrize(
    "arch, bits, group_size, symmetric, actorder, expected",
    [
        ("llama", 4, 16, True, False, 8),  # llm-compressor's W4A16: symmetric groups
        ("qwen2", 4, 32, False, False, 8),  # asymmetric: zero points packed along the rows
        ("qwen3", 4, None, True, False, 8),  # per channel: one group over each row
        ("llama", 4, 16, True, True, 0),  # actorder "group": g_idx permutes the inputs, dequantized at load
        ("mistral", 8, None, True, False, 0),  # W8A16: dequantized at load
    ],
    ids=["w4a16", "w4a16-asymmetric", "w4a16-channel", "w4a16-actorder", "w8a16"],
)
def test_kept_pack_quantized_layers_give_the_dequantized_model_s_logits(
    tmp_path, arch, bits, group_size, symmetric, actorder, expected
):
    hf, _ = write_pack_quantized_checkpoint(tmp_path, arch, bits, group_size, symmetric, actorder)
    platform = keeping_int4(CpuPlatform())
    kept, dequantized = make_runner(platform, tmp_path), make_runner(CpuPlatform(), tmp_path)
    try:
        linears = [m for m in kept.model.modules() if isinstance(m, Linear) and m.int4 is not None]
        assert len(linears) == expected
        assert all(m.group_size == (group_size or m.in_features) for m in linears)
        described = kept.describe()["weights"]
        assert (f"{expected} linear layers kept in int4" in described) == bool(expected), described
        calls = platform.calls["int4_linear"]
        logits = prefill_logits(kept)
        assert (platform.calls["int4_linear"] > calls) == bool(expected)
        assert torch.equal(logits, prefill_logits(dequantized))  # the same weights, multiplied as at load
        assert greedy_generate(kept, PROMPTS, 8) == [hf_greedy(hf, prompt, 8) for prompt in PROMPTS]
    finally:
        kept.close()
        dequantized.close()


def test_a_full_precision_weight_for_a_layer_the_config_quantizes_is_refused_in_one_line(tmp_path):
    """A layer left unquantized in the checkpoint but not named in the config's modules_to_not_convert."""
    write_int4_checkpoint(tmp_path, "llama", "awq", 16, keep=("layers.1.self_attn.k_proj",))
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"]["modules_to_not_convert"] = None
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"^[^\n]*$") as caught:
        make_runner(keeping_int4(CpuPlatform()), tmp_path)
    assert "k_proj.weight' is stored as float32, but its layer keeps the int4 weights" in str(caught.value)
    assert "modules_to_not_convert" in str(caught.value)


def test_act_order_g_idx_under_a_config_without_desc_act_is_refused(tmp_path):
    write_int4_checkpoint(tmp_path, "llama", "gptq", 32, act_order=True)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"]["desc_act"] = False
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="g_idx is in act order though its config says desc_act false"):
        make_runner(keeping_int4(CpuPlatform()), tmp_path)


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_dummy_weights_load_for_an_awq_config_kept_and_dequantized(tmp_path, arch):
    """`--load-format dummy` of an AWQ shape (as the llama-3-8b-awq and qwen3-30b-a3b-awq presets): random packed
    words and scales where the layers (and the experts) keep them, the model dtype's random weights where they are
    dequantized; both run."""
    from omnirun.loader.presets import PRESETS
    from omnirun.testing import tiny_configs, tiny_moe_configs

    config = {**tiny_configs(), **tiny_moe_configs()}[arch]
    config.quantization_config = dict(PRESETS["llama-3-8b-awq"].kwargs["quantization_config"], group_size=32)
    config.save_pretrained(tmp_path)
    for platform, held in (
        (keeping_int4(CpuPlatform()), "linear layers kept in int4"),
        (CpuPlatform(), "dequantized"),
    ):
        runner = make_runner(platform, tmp_path, load_format="dummy")
        try:
            assert held in runner.describe()["weights"]
            if arch == "qwen3_moe":
                assert ("packed in int4" in runner.describe()["experts"]) == (held != "dequantized")
            logits = prefill_logits(runner)
            assert torch.isfinite(logits).all() and logits.std() > 0
        finally:
            runner.close()


def test_reading_a_kept_layer_s_weights_gives_what_it_keeps_and_weight_is_one_line_naming_them(tmp_path):
    """get_weights_by_name on a layer that keeps int4 weights: its stored tensors by their names (the packed words,
    scales and zero points, q of the fused q|k|v included), and for `.weight`, which it does not store, a one-line
    error that names what to read instead."""
    write_int4_checkpoint(tmp_path, "llama", "awq", 16)
    runner = make_runner(keeping_int4(CpuPlatform()), tmp_path)
    try:
        layer = runner.model.model.layers[0].self_attn.qkv_proj
        q_rows = layer.shard_offsets["q"][1]
        packed = runner.get_weights_by_name("model.layers.0.self_attn.q_proj.weight_packed")
        assert torch.equal(packed, layer.weight_packed[:q_rows])
        scales = runner.get_weights_by_name("model.layers.0.mlp.down_proj.weight_scale")
        assert torch.equal(scales, runner.model.model.layers[0].mlp.down_proj.weight_scale)
        with pytest.raises(WeightUpdateError, match=r"^[^\n]*$") as caught:
            runner.get_weights_by_name("model.layers.0.self_attn.k_proj.weight")
        assert "keeps the int4 weights" in str(caught.value)
        assert "'model.layers.0.self_attn.k_proj.weight_packed'" in str(caught.value)
    finally:
        runner.close()
