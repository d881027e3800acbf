"""`quant_method: "compressed-tensors"` checkpoints (llm-compressor's), as far as omnirun loads them: the
"float-quantized" format with 8-bit float weights per tensor, per channel or per block, any activation scheme, and
the "pack-quantized" format with 4- or 8-bit int weights per group or channel and 16-bit activations (W4A16,
W8A16: omnirun.quantization.pack_quantized). The config's `config_groups` say, per group of target layers, how its
`weights` and `input_activations` are quantized (compressed-tensors' QuantizationArgs: num_bits, type, strategy,
dynamic, block_structure); layers in `ignore` are saved unquantized and load as they are. A `kv_cache_scheme` adds
`k_scale`/`v_scale` tensors: the attention layers load them for an fp8 KV cache (omnirun.models.decoder)."""

from __future__ import annotations

import dataclasses
from typing import Any

from omnirun.errors import ModelLoadError
from omnirun.quantization.fp8 import STRATEGIES, Fp8Format, block_shape
from omnirun.quantization.pack_quantized import PackedIntFormat

FORMATS = ("float-quantized", "pack-quantized", "int-quantized")


def from_config(quantization: dict[str, Any]) -> Fp8Format | PackedIntFormat:
    groups = quantization.get("config_groups") or {}
    if not groups:
        raise ModelLoadError("the compressed-tensors config has no config_groups: re-save the checkpoint")
    # The format is the config's, or (newer llm-compressor) each group's.
    formats = {quantization.get("format")} if quantization.get("format") else {g.get("format") for g in groups.values()}
    if len(formats) != 1 or not formats <= set(FORMATS):
        raise ModelLoadError(
            f"compressed-tensors format {', '.join(sorted(map(str, formats)))} is not supported yet: omnirun loads "
            f"{', '.join(FORMATS)} (fp8 weights; int4/int8 packed weights; int8 weights), one per checkpoint"
        )
    _check_kv_cache_scheme(quantization.get("kv_cache_scheme"))
    if formats == {"float-quantized"}:
        return _float(quantization, groups)
    integer = _integer(groups, packed=formats == {"pack-quantized"})
    return dataclasses.replace(integer, ignored=tuple(quantization.get("ignore") or ()))


def _check_kv_cache_scheme(scheme: dict[str, Any] | None) -> None:
    """The KV-cache scales the attention layers load: one k_scale and one v_scale per layer (strategy "tensor")."""
    if scheme is not None and scheme.get("strategy", "tensor") != "tensor":
        raise ModelLoadError(
            f"compressed-tensors kv_cache_scheme strategy {scheme.get('strategy')!r} is not supported: omnirun reads "
            "per-tensor k_scale/v_scale (strategy 'tensor'); re-quantize the KV cache scales per tensor"
        )


def _integer(groups: dict[str, Any], packed: bool) -> PackedIntFormat:
    schemes = set()
    for name, group in groups.items():
        if packed and group.get("input_activations"):
            raise ModelLoadError(
                f"compressed-tensors group {name!r} quantizes its input activations: omnirun loads pack-quantized "
                "weights with 16-bit activations (W4A16, W8A16) only"
            )
        schemes.add(PackedIntFormat.from_weights(name, group.get("weights") or {}, packed))
    if len(schemes) > 1:
        raise ModelLoadError(f"compressed-tensors groups with different weight schemes ({sorted(schemes, key=str)})")
    return schemes.pop()


def _float(quantization: dict[str, Any], groups: dict[str, Any]) -> Fp8Format:
    schemes = set()
    static = False
    for name, group in groups.items():
        weights = group.get("weights") or {}
        if weights.get("type") != "float" or weights.get("num_bits") != 8:
            raise ModelLoadError(
                f"compressed-tensors group {name!r} has {weights.get('num_bits')}-bit {weights.get('type')} weights: "
                "omnirun loads 8-bit float weights only"
            )
        strategy = weights.get("strategy")
        if strategy not in STRATEGIES:
            raise ModelLoadError(
                f"compressed-tensors group {name!r} has weight strategy {strategy!r}: expected one of "
                f"{', '.join(STRATEGIES)}"
            )
        block = block_shape(weights.get("block_structure"), "block_structure") if strategy == "block" else None
        schemes.add((strategy, block))
        activations = group.get("input_activations") or {}
        static = static or (bool(activations) and not activations.get("dynamic", False))
    if len(schemes) > 1:
        raise ModelLoadError(f"compressed-tensors groups with different weight schemes ({sorted(schemes, key=str)})")
    ((strategy, block),) = schemes
    return Fp8Format(
        strategy,
        block,
        "weight_scale",
        static_activations=static,
        source="compressed-tensors",
        ignored=tuple(quantization.get("ignore") or ()),
    )
