"""Quantized checkpoints for tests, written from each format's published layout (not from omnirun's reader): a tiny
random HF model saved with its decoder projections quantized, and the HF model holding the weights they stand for."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from omnirun.registry import select_platform
from omnirun.testing import greedy_generate, hf_greedy, make_runner, tiny_hf_model

E4M3_MAX = 448.0  # float8_e4m3fn's largest finite value
PROMPTS = [[5, 17, 99, 3, 250, 42, 7], [1, 2, 3]]


def quantized_in_checkpoints(name: str) -> bool:
    """The decoder weights quantized checkpoints store quantized: the projections, and each expert's (Mixtral's
    w1 / w2 / w3 too); not norms, embeddings, the LM head or a mixture's router."""
    return ".layers." in name and (name.endswith("proj.weight") or re.search(r"\.experts\.\d+\.w[123]\.weight$", name))


def assert_loads_as(path: Path, hf, stands_for: dict[str, torch.Tensor], described: str) -> None:
    """omnirun on cpu loads the checkpoint at `path` as `described`, every weight equal to what it stands for bit
    for bit (greedy tokens alone would miss a slightly wrong scale), and its greedy tokens equal `hf`'s."""
    runner = make_runner(select_platform("cpu"), path)
    try:
        assert runner.describe()["weights"] == f"{described}, dequantized to float32 at load"
        for name, weight in stands_for.items():
            assert torch.equal(runner.get_weights_by_name(name), weight), name
        tokens = greedy_generate(runner, PROMPTS, max_new_tokens=8)
    finally:
        runner.close()
    assert tokens == [hf_greedy(hf, prompt, 8) for prompt in PROMPTS]


def prefill_logits(runner) -> torch.Tensor:
    """Every position's logits of PROMPTS prefilled together (the kept-vs-dequantized tests compare them)."""
    from omnirun.batch import build_batch

    rows = [runner.kv.new_request() for _ in PROMPTS]
    batch = build_batch(runner.kv, rows, [0] * len(PROMPTS), PROMPTS, runner.device)
    batch.return_full_logits = True
    return runner.forward(batch).clone()


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
        if quantized_in_checkpoints(name) and not any(k in name for k in keep):
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
            "modules_to_not_convert": ["lm_head", *keep],  # as transformers' FineGrainedFP8Config writes it
        }
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config))
    hf.load_state_dict(dequantized_weights, strict=False)
    return hf, dequantized_weights


# --- int4: AWQ (AutoAWQ's WQLinear_GEMM.from_linear) and GPTQ (AutoGPTQ's QuantLinear.pack) ---------------------

AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ: nibble i of a word holds column 8c + AWQ_PACK_ORDER[i]


def quantize_groups(
    weight: torch.Tensor, group_of_input: torch.Tensor, groups: int, bits: int = 4, symmetric: bool = False
):
    """Integer quantization of weight [N, K] per (group of inputs, output): (q [K, N], zeros [groups, N], scales
    [groups, N]) with weight[n, k] ~ (q[k, n] - zeros[g, n]) x scales[g, n], g the group of k. Asymmetric (the
    group's range over 2^bits - 1 steps), or symmetric as GPTQ's `sym` (zero 2^(bits-1), scale max|w| x 2 / top)."""
    w = weight.float().t()  # [K, N]
    top = (1 << bits) - 1
    scales, zeros = torch.empty(groups, w.shape[1]), torch.empty(groups, w.shape[1], dtype=torch.int32)
    q = torch.empty(w.shape, dtype=torch.int32)
    for g in range(groups):
        rows = group_of_input == g
        low, high = w[rows].amin(0).clamp(max=0), w[rows].amax(0).clamp(min=0)
        if symmetric:
            high = torch.maximum(-low, high)
            low = -high
        scales[g] = ((high - low) / top).clamp(min=1e-6).half().float()  # the checkpoint stores float16 scales
        zeros[g] = (1 << (bits - 1)) if symmetric else torch.round(-low / scales[g]).clamp(0, top).int()
        q[rows] = (torch.round(w[rows] / scales[g]) + zeros[g]).clamp(0, top).int()
    return q, zeros, scales


def _pack_columns(values: torch.Tensor, order: list[int], bits: int = 4) -> torch.Tensor:
    """[R, C] ints -> int32 [R, C * bits / 32], field i of word c holding column c * per_word + order[i]."""
    per_word = 32 // bits
    packed = torch.zeros(values.shape[0], values.shape[1] // per_word, dtype=torch.int64)
    for c in range(packed.shape[1]):
        for i in range(per_word):
            packed[:, c] |= values[:, c * per_word + order[i]].long() << (i * bits)
    return _as_int32(packed)


def _pack_rows(values: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """[R, C] ints -> int32 [R * bits / 32, C], field i of word r holding row r * per_word + i."""
    per_word = 32 // bits
    packed = torch.zeros(values.shape[0] // per_word, values.shape[1], dtype=torch.int64)
    for r in range(packed.shape[0]):
        for i in range(per_word):
            packed[r] |= values[r * per_word + i].long() << (i * bits)
    return _as_int32(packed)


def _as_int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit words as the int32 the checkpoints store (two's complement)."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def write_int4_checkpoint(
    path: Path,
    arch: str,
    method: str,
    group_size: int,
    act_order: bool = False,
    *,
    symmetric: bool = False,
    keep: tuple[str, ...] = (),
):
    """A tiny random `arch` model saved as an AWQ ("awq") or GPTQ ("gptq", act order and `symmetric` optional)
    checkpoint of its decoder projections, those named in `keep` left in full precision (and listed in the config's
    modules_to_not_convert); returns the HF model with the weights the checkpoint stands for in their place."""
    hf = tiny_hf_model(arch)
    hf.save_pretrained(path)
    tensors = load_file(path / "model.safetensors")
    stands_for = {}
    gen = torch.Generator().manual_seed(11)
    for name in list(tensors):
        if not quantized_in_checkpoints(name) or any(k in name for k in keep):
            continue
        weight = tensors.pop(name)
        layer = name.removesuffix(".weight")
        in_features = weight.shape[1]
        groups = in_features // group_size
        group_of_input = torch.arange(in_features) // group_size
        if act_order:  # GPTQ's desc_act: groups follow a permutation of the inputs
            group_of_input = group_of_input[torch.randperm(in_features, generator=gen)]
        q, zeros, scales = quantize_groups(weight, group_of_input, groups, symmetric=symmetric)
        stands_for[name] = ((q - zeros[group_of_input]).float() * scales[group_of_input]).t()
        tensors[f"{layer}.scales"] = scales.half()
        if method == "awq":
            tensors[f"{layer}.qweight"] = _pack_columns(q, AWQ_PACK_ORDER)
            tensors[f"{layer}.qzeros"] = _pack_columns(zeros, AWQ_PACK_ORDER)
        else:
            tensors[f"{layer}.qweight"] = _pack_rows(q)
            tensors[f"{layer}.qzeros"] = _pack_columns(zeros - 1, list(range(8)))  # "gptq" stores zero - 1
            tensors[f"{layer}.g_idx"] = group_of_input.int()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    if method == "awq":
        config["quantization_config"] = {
            "quant_method": "awq",
            "bits": 4,
            "group_size": group_size,
            "zero_point": True,
            "version": "gemm",
            "modules_to_not_convert": list(keep) or None,
        }
    else:
        config["quantization_config"] = {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": group_size,
            "desc_act": act_order,
            "sym": symmetric,
            "checkpoint_format": "gptq",
            **({"modules_to_not_convert": list(keep)} if keep else {}),
        }
    (path / "config.json").write_text(json.dumps(config))
    hf.load_state_dict(stands_for, strict=False)
    return hf, stands_for


# --- compressed-tensors pack-quantized (llm-compressor's W4A16 / W8A16: PackedQuantizationCompressor) -----------


def _pack_signed(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """compressed-tensors' pack_to_int32: signed ints shifted to unsigned (+ 2^(bits-1)), padded to whole words,
    field i of word j along `dim` holding position j * per_word + i, the lowest bits first."""
    per_word = 32 // bits
    unsigned = (values.long() + (1 << (bits - 1))).movedim(dim, 0)
    padding = -unsigned.shape[0] % per_word
    unsigned = torch.cat([unsigned, unsigned.new_zeros(padding, *unsigned.shape[1:])])
    packed = torch.zeros(unsigned.shape[0] // per_word, *unsigned.shape[1:], dtype=torch.int64)
    for i in range(per_word):
        packed |= unsigned[i::per_word] << (bits * i)
    return _as_int32(packed.movedim(0, dim).contiguous())


def write_pack_quantized_checkpoint(
    path: Path,
    arch: str,
    bits: int,
    group_size: int | None,
    symmetric: bool,
    actorder: bool = False,
    packed: bool = True,
):
    """A tiny random `arch` model saved as a compressed-tensors pack-quantized checkpoint of its decoder projections
    (group_size None: per channel; actorder: groups over a permutation of the inputs, saved as weight_g_idx), or
    with `packed` False an int-quantized one (int8 weights and zero points as they are, int8 dynamic activations,
    as llm-compressor's W8A8 saves them); returns the HF model with the weights the checkpoint stands for in their
    place, and those weights by name."""
    hf = tiny_hf_model(arch)
    hf.save_pretrained(path)
    tensors = load_file(path / "model.safetensors")
    stands_for = {}
    gen = torch.Generator().manual_seed(13)
    low, high = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    for name in list(tensors):
        if not (".layers." in name and name.endswith("proj.weight")):
            continue
        weight = tensors.pop(name).float()
        layer = name.removesuffix(".weight")
        rows, columns = weight.shape
        size = group_size or columns
        group = torch.arange(columns) // size
        if actorder:
            group = group[torch.randperm(columns, generator=gen)]
        groups = -(-columns // size)
        scale, zero = torch.empty(rows, groups), torch.zeros(rows, groups, dtype=torch.int64)
        q = torch.empty(rows, columns, dtype=torch.int64)
        for g in range(groups):
            part = weight[:, group == g]
            if symmetric:
                scale[:, g] = (part.abs().amax(1) / high).clamp(min=1e-6)
            else:
                lo, hi = part.amin(1).clamp(max=0), part.amax(1).clamp(min=0)
                scale[:, g] = ((hi - lo) / (high - low)).clamp(min=1e-6)
                zero[:, g] = (low - torch.round(lo / scale[:, g])).clamp(low, high).long()
            scale[:, g] = scale[:, g].to(torch.bfloat16).float()  # the checkpoint stores the model dtype
            q[:, group == g] = (torch.round(part / scale[:, g : g + 1]) + zero[:, g : g + 1]).clamp(low, high).long()
        stands_for[name] = (q - zero[:, group]).float() * scale[:, group]
        tensors[f"{layer}.weight_scale"] = scale.to(torch.bfloat16)
        if packed:
            tensors[f"{layer}.weight_packed"] = _pack_signed(q, bits, dim=1)
            tensors[f"{layer}.weight_shape"] = torch.tensor([rows, columns], dtype=torch.int64)
        else:
            tensors[f"{layer}.weight"] = q.to(torch.int8)
        if not symmetric:
            tensors[f"{layer}.weight_zero_point"] = _pack_signed(zero, bits, dim=0) if packed else zero.to(torch.int8)
        if actorder:
            tensors[f"{layer}.weight_g_idx"] = group.int()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    weights = {
        "num_bits": bits,
        "type": "int",
        "symmetric": symmetric,
        "strategy": "group" if group_size else "channel",
        "group_size": group_size,
        "actorder": "group" if actorder else None,
        "dynamic": False,
    }
    activations = None if packed else {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized" if packed else "int-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": activations}},
        "ignore": ["lm_head"],
        "quantization_status": "compressed",
    }
    (path / "config.json").write_text(json.dumps(config))
    hf.load_state_dict(stands_for, strict=False)
    return hf, stands_for
