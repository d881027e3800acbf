"""fp8 weights (float8_e4m3fn) with float32 scales, dequantized as weight = fp8 value x its scale:
- `quant_method: "fp8"` (fp8.py of vLLM reads the same names): block-wise, as DeepSeek-V3, Qwen3-FP8 and
  transformers' FineGrainedFP8Config save them (`weight_block_size` [128, 128], `<layer>.weight_scale_inv` of
  shape [ceil(N / 128), ceil(K / 128)], the last blocks partial), or per-tensor (AutoFP8: a scalar
  `<layer>.weight_scale`, and `<layer>.input_scale` with static activations);
- compressed-tensors' float-quantized weights (omnirun.quantization.compressed_tensors): `<layer>.weight_scale`
  per tensor, per output channel ([N, 1]) or per block."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from omnirun.errors import ModelLoadError
from omnirun.layers.linear import Fp8Weights, QuantizedOf
from omnirun.layers.native_ops import dequantize_fp8
from omnirun.layers.ops import Ops, runs_fp8_weights
from omnirun.quantization.int4 import listed

STRATEGIES = ("tensor", "channel", "block")


@dataclasses.dataclass(frozen=True)
class Fp8Format:
    strategy: str  # one of STRATEGIES: what one scale covers
    block: tuple[int, int] | None  # (rows, columns) of a block, for strategy "block"
    scale_suffix: str  # the scale tensor beside `<layer>.weight`: "weight_scale_inv" or "weight_scale"
    static_activations: bool  # an `input_scale` per layer, read and dropped (activations stay unquantized)
    source: str = "fp8"  # the quant_method, for messages
    ignored: tuple[str, ...] = ()  # modules the checkpoint holds unquantized (see `quantizes`)

    @classmethod
    def from_config(cls, quantization: dict[str, Any]) -> Fp8Format:
        """A `quant_method: "fp8"` config."""
        fmt = quantization.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ModelLoadError(f"fp8 checkpoints in fmt {fmt!r} are not supported: omnirun loads fmt e4m3")
        scheme = quantization.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            raise ModelLoadError(f"fp8 activation_scheme {scheme!r} is unknown: expected dynamic or static")
        block = quantization.get("weight_block_size")
        # transformers writes modules_to_not_convert, vLLM's Fp8Config reads ignored_layers.
        ignored = tuple(quantization.get("modules_to_not_convert") or quantization.get("ignored_layers") or ())
        if block is None:
            return cls("tensor", None, "weight_scale", static_activations=scheme == "static", ignored=ignored)
        return cls(
            "block", block_shape(block), "weight_scale_inv", static_activations=scheme == "static", ignored=ignored
        )

    def describe(self) -> str:
        what = f"block {list(self.block)}" if self.strategy == "block" else f"per-{self.strategy}"
        return f"{self.source} fp8 {what}" if self.source != "fp8" else f"fp8 {what}"

    def layer_of(self, name: str, dtype: torch.dtype) -> str | None:
        if name.endswith(".weight") and dtype.is_floating_point and dtype.itemsize == 1:
            return name.removesuffix(".weight")
        if name.endswith(f".{self.scale_suffix}"):
            return name.removesuffix(f".{self.scale_suffix}")
        return None

    def part_names(self, layer: str) -> tuple[str, ...]:
        return (f"{layer}.weight", f"{layer}.{self.scale_suffix}")

    def dropped(self, name: str) -> bool:
        return self.static_activations and name.endswith(".input_scale")

    def quantizes(self, module: str) -> bool:
        """Whether the checkpoint holds `module` (an HF module name) quantized: not in the config's ignore list
        (names matched as substrings, as transformers matches modules_to_not_convert; "re:" entries as regular
        expressions, as compressed-tensors writes them)."""
        return not listed(module, self.ignored)

    def kept_by(self, ops: Ops) -> bool:
        """Whether layers keep these fp8 weights on a platform of this op table (it runs `fp8_linear`)."""
        return runs_fp8_weights(ops)

    def quantized_of(self) -> QuantizedOf:
        """The layers that keep this checkpoint's fp8 weights: every linear layer whose modules it quantizes."""
        weights = Fp8Weights(self.block if self.strategy == "block" else None)
        return lambda modules: weights if all(self.quantizes(m) for m in modules) else None

    def kept(self, parts: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """The layer's parameters as an fp8 layer keeps them (omnirun.layers.linear.Fp8Weights): its `weight` and a
        float32 `weight_scale` per output row (a per-tensor scale repeated, so that fused projections keep each their
        own) or per block."""
        weight, scale = self._checked(parts)
        return {"weight": weight, "weight_scale": scale}

    def _checked(self, parts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        weight, scale = parts
        if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
            raise ModelLoadError(
                f"an fp8 weight must be a 2-D float8_e4m3fn tensor, got {list(weight.shape)} {weight.dtype}"
            )
        rows, cols = weight.shape
        scale = scale.float()
        if self.strategy == "tensor":
            if scale.numel() != 1:
                raise ModelLoadError(f"a per-tensor fp8 weight_scale holds one value, got shape {list(scale.shape)}")
            return weight, scale.reshape(1).expand(rows).contiguous()
        if self.strategy == "channel":
            if scale.numel() != rows:
                raise ModelLoadError(
                    f"a per-channel fp8 weight of {rows} rows needs {rows} scales, got shape {list(scale.shape)}"
                )
            return weight, scale.reshape(rows)
        expected = (-(-rows // self.block[0]), -(-cols // self.block[1]))
        if tuple(scale.shape) != expected:
            raise ModelLoadError(
                f"an fp8 weight of shape {[rows, cols]} in {list(self.block)} blocks needs {self.scale_suffix} of "
                f"shape {list(expected)}, got {list(scale.shape)}: the config's block size does not match it"
            )
        return weight, scale

    def dequantize(self, parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """weight [N, K] in fp8 x its scales -> [N, K] in `dtype` (the product taken in float32)."""
        weight, scale = self._checked(parts)
        return dequantize_fp8(weight, scale, self.block).to(dtype)


def block_shape(block: object, key: str = "weight_block_size") -> tuple[int, int]:
    """A config's block size (its `key`), checked: two positive integers."""
    if not (isinstance(block, list | tuple) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ModelLoadError(f"fp8 {key} {block!r} is invalid: expected two positive integers")
    return (block[0], block[1])
