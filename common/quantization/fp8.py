"""`quant_method: "fp8"` checkpoints: float8_e4m3fn weights with float32 scales, block-wise (DeepSeek-V3, Qwen3-FP8
and transformers' FineGrainedFP8Config: `weight_block_size` [128, 128] and `<layer>.weight_scale_inv` of shape
[ceil(N / 128), ceil(K / 128)]) or per-tensor (AutoFP8 and vLLM's Fp8Config: a scalar `<layer>.weight_scale`, and
`<layer>.input_scale` with static activations). Either way weight = fp8 value x its block's (or the tensor's) scale,
as vLLM's Fp8LinearMethod reads these names (vllm/model_executor/layers/quantization/fp8.py)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from omnirun.errors import ModelLoadError

FP8_DTYPES = (torch.float8_e4m3fn,)


@dataclasses.dataclass(frozen=True)
class Fp8Format:
    block: tuple[int, int] | None  # (rows, columns) of a weight block; None: one scale per tensor
    static_activations: bool  # checkpoints with `activation_scheme: static` carry an input_scale per layer

    @classmethod
    def from_config(cls, quantization: dict[str, Any]) -> Fp8Format:
        fmt = quantization.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ModelLoadError(f"fp8 checkpoints in fmt {fmt!r} are not supported: omnirun loads fmt e4m3")
        scheme = quantization.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            raise ModelLoadError(f"fp8 activation_scheme {scheme!r} is unknown: expected dynamic or static")
        block = quantization.get("weight_block_size")
        if block is not None:
            if not (
                isinstance(block, list | tuple) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)
            ):
                raise ModelLoadError(f"fp8 weight_block_size {block!r} is invalid: expected two positive integers")
            block = (block[0], block[1])
        return cls(block=block, static_activations=scheme == "static")

    def describe(self) -> str:
        return f"fp8 block {list(self.block)}" if self.block else "fp8 per-tensor"

    def scale_names(self, weight_name: str) -> tuple[str, ...]:
        return (f"{weight_name}_scale_inv",) if self.block else (f"{weight_name}_scale",)

    def extra_names(self, weight_name: str) -> tuple[str, ...]:
        layer = weight_name.removesuffix(".weight")
        return (f"{layer}.input_scale",) if self.static_activations else ()

    def dequantize(self, weight: torch.Tensor, scales: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """weight [N, K] in fp8 x its scales -> [N, K] in `dtype` (the product taken in float32)."""
        (scale,) = scales
        if weight.dtype not in FP8_DTYPES or weight.dim() != 2:
            raise ModelLoadError(
                f"an fp8 weight must be a 2-D float8_e4m3fn tensor, got {list(weight.shape)} {weight.dtype}"
            )
        scale = scale.float()
        if self.block is None:
            if scale.numel() != 1:
                raise ModelLoadError(f"a per-tensor fp8 weight_scale holds one value, got shape {list(scale.shape)}")
            return (weight.float() * scale.reshape(())).to(dtype)
        rows, cols = weight.shape
        block_rows, block_cols = self.block
        expected = (-(-rows // block_rows), -(-cols // block_cols))
        if tuple(scale.shape) != expected:
            raise ModelLoadError(
                f"an fp8 weight of shape {[rows, cols]} in {list(self.block)} blocks needs weight_scale_inv of shape "
                f"{list(expected)}, got {list(scale.shape)}: the checkpoint's weight_block_size does not match it"
            )
        per_element = scale.repeat_interleave(block_rows, 0)[:rows].repeat_interleave(block_cols, 1)[:, :cols]
        return (weight.float() * per_element).to(dtype)
