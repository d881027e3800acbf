"""fp8 checkpoints (`quant_method: "fp8"` block-wise and per-tensor; compressed-tensors' float-quantized per
channel), written by a helper from the published layouts and loaded by dequantizing once at load: greedy tokens
equal HF transformers run on the dequantized weights (float32, exact), and a bad checkpoint is refused in one
line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from omnirun.errors import ModelLoadError
from omnirun.quantization import dequantized, quantized_format
from omnirun.registry import select_platform
from omnirun.testing import greedy_generate, hf_greedy, make_runner, tiny_hf_model

E4M3_MAX = 448.0  # float8_e4m3fn's largest finite value
PROMPTS = [[5, 17, 99, 3, 250, 42, 7], [1, 2, 3]]


def quantize_fp8(weight: torch.Tensor, block: tuple[int, int] | str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 scale) as DeepSeek-V3's and transformers' FineGrainedFP8 checkpoints store
    them: per [rows, columns] block (the last ones partial) scale = amax / 448 and weight ~ fp8 x scale (the scale
    is saved as `weight_scale_inv`, of shape [ceil(N / rows), ceil(K / columns)]); block None: one scale per tensor
    (AutoFP8's `weight_scale`); "channel": one per output row, shape [N, 1] (compressed-tensors' `weight_scale`)."""
    w = weight.float()
    if block is None:
        scale = (w.abs().amax() / E4M3_MAX).clamp(min=1e-12)
        return (w / scale).to(torch.float8_e4m3fn), scale
    if block == "channel":
        scale = (w.abs().amax(dim=1, keepdim=True) / E4M3_MAX).clamp(min=1e-12)
        return (w / scale).to(torch.float8_e4m3fn), scale
    rows, cols = w.shape
    scale = torch.empty(-(-rows // block[0]), -(-cols // block[1]))
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            part = (slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1]))
            scale[i, j] = (w[part].abs().amax() / E4M3_MAX).clamp(min=1e-12)
            q[part] = (w[part] / scale[i, j]).to(torch.float8_e4m3fn)
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """The weight an fp8 checkpoint stands for, block by block (the test's own reading of the layout)."""
    if block is None or block == "channel":
        return q.float() * scale  # one scale, or one per row ([N, 1]) broadcast along it
    out = torch.empty(q.shape)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            part = (slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1]))
            out[part] = q[part].float() * scale[i, j]
    return out


def write_fp8_checkpoint(
    path: Path, arch: str, block: tuple[int, int] | str | None, keep: tuple[str, ...] = (), static: bool = False
):
    """A tiny random `arch` model saved with its decoder projections in fp8 (those named in `keep` left in float32,
    as `modules_to_not_convert` and compressed-tensors' `ignore` leave them); block "channel" writes a
    compressed-tensors checkpoint with a kv_cache_scheme (k_scale/v_scale tensors). Returns the HF model with the
    dequantized weights in their place, and those weights by name."""
    hf = tiny_hf_model(arch)
    hf.save_pretrained(path)
    tensors = load_file(path / "model.safetensors")
    dequantized_weights = {}
    for name in list(tensors):
        if ".layers." in name and name.endswith("proj.weight") and not any(k in name for k in keep):
            q, scale = quantize_fp8(tensors[name], block)
            tensors[name] = q
            tensors[f"{name}_scale_inv" if isinstance(block, tuple) else f"{name}_scale"] = scale
            if static:  # an activation scale, which weights dequantized at load do not use
                tensors[f"{name.removesuffix('.weight')}.input_scale"] = torch.tensor(0.02)
            dequantized_weights[name] = dequantize_fp8(q, scale, block)
    config = json.loads((path / "config.json").read_text())
    if block == "channel":
        for layer in range(config["num_hidden_layers"]):
            for kv in "kv":
                tensors[f"model.layers.{layer}.self_attn.{kv}_scale"] = torch.tensor(1.5)
        activations = {
            "num_bits": 8,
            "type": "float",
            "strategy": "tensor" if static else "token",
            "dynamic": not static,
        }
        config["quantization_config"] = {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {
                        "num_bits": 8,
                        "type": "float",
                        "strategy": "channel",
                        "symmetric": True,
                        "dynamic": False,
                    },
                    "input_activations": activations,
                }
            },
            "ignore": ["lm_head", *keep],
            "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False},
        }
    else:
        config["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "static" if static else "dynamic",
            **({"weight_block_size": list(block)} if block else {}),
        }
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config))
    hf.load_state_dict(dequantized_weights, strict=False)
    return hf, dequantized_weights


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
    runner = make_runner(select_platform("cpu"), tmp_path)
    try:
        expected = {None: "fp8 per-tensor", "channel": "compressed-tensors fp8 per-channel"}.get(
            block, "fp8 block [24, 40]"
        )
        assert runner.describe()["weights"] == f"{expected}, dequantized to float32 at load"
        for name, weight in dequantized_weights.items():  # bit for bit: tokens alone miss a slightly wrong scale
            assert torch.equal(runner.get_weights_by_name(name), weight), name
        tokens = greedy_generate(runner, PROMPTS, max_new_tokens=8)
    finally:
        runner.close()
    assert tokens == [hf_greedy(hf, prompt, 8) for prompt in PROMPTS]


def test_scales_before_their_weights_and_other_tensors_pass_through():
    fmt = quantized_format(_Config({"quant_method": "fp8", "weight_block_size": [2, 2]}))
    q, scale = quantize_fp8(torch.randn(3, 5), (2, 2))
    stream = [("a.weight_scale_inv", scale), ("norm.weight", torch.ones(4)), ("a.weight", q)]
    out = dict(dequantized(iter(stream), fmt, torch.float32))
    assert list(out) == ["norm.weight", "a.weight"]
    assert torch.equal(out["a.weight"], dequantize_fp8(q, scale, (2, 2)))


class _Config:
    def __init__(self, quantization: dict):
        self.quantization_config = quantization


@pytest.mark.parametrize(
    "quantization, stream, message",
    [
        (
            {"quant_method": "awq"},
            [],
            "quant_method 'awq', which omnirun cannot load yet (supported: fp8, compressed-tensors)",
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
            {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {}},
            [],
            "compressed-tensors format 'pack-quantized' is not supported yet",
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
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes(b"not read")
    with pytest.raises(ModelLoadError, match="quant_method 'gptq', which omnirun cannot load yet"):
        make_runner(select_platform("cpu"), tmp_path)
