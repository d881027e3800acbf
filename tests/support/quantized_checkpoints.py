"""Quantized checkpoints for tests, written from each format's published layout (not from omnirun's reader): a tiny
random HF model saved with its decoder projections quantized, and the HF model holding the weights they stand for."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from omnirun.testing import tiny_hf_model

E4M3_MAX = 448.0  # float8_e4m3fn's largest finite value


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
