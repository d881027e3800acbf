"""`quant_method: "compressed-tensors"` checkpoints (llm-compressor's), as far as omnirun loads them: the
"float-quantized" format with 8-bit float weights per tensor, per channel or per block, any activation scheme.
The config's `config_groups` say, per group of target layers, how its `weights` and `input_activations` are
quantized (compressed-tensors' QuantizationArgs: num_bits, type, strategy, dynamic, block_structure); layers in
`ignore` are saved unquantized and load as they are. A `kv_cache_scheme` adds `k_scale`/`v_scale` tensors."""

from __future__ import annotations

from typing import Any

from omnirun.errors import ModelLoadError
from omnirun.quantization.fp8 import STRATEGIES, Fp8Format, block_shape

FORMATS = ("float-quantized",)


def from_config(quantization: dict[str, Any]) -> Fp8Format:
    fmt = quantization.get("format")
    if fmt not in FORMATS:
        raise ModelLoadError(
            f"compressed-tensors format {fmt!r} is not supported yet: omnirun loads {', '.join(FORMATS)} (fp8 weights)"
        )
    groups = quantization.get("config_groups") or {}
    if not groups:
        raise ModelLoadError("the compressed-tensors config has no config_groups: re-save the checkpoint")
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
        kv_scales=quantization.get("kv_cache_scheme") is not None,
        source="compressed-tensors",
    )
