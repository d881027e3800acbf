"""Which quantized format a checkpoint is in, read from its config's `quantization_config`, and refused before any
weight is read when omnirun cannot load it."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from omnirun.errors import ModelLoadError
from omnirun.layers.linear import QuantizedOf
from omnirun.layers.ops import Ops
from omnirun.quantization import compressed_tensors
from omnirun.quantization.fp8 import Fp8Format
from omnirun.quantization.int4 import AwqFormat, GptqFormat


class QuantizedFormat(Protocol):
    """A checkpoint's quantized layout: which tensors make a layer's weight, and the weight they make."""

    def describe(self) -> str: ...

    def layer_of(self, name: str, dtype: torch.dtype) -> str | None:
        """The layer whose quantized weight the tensor `name` (stored as `dtype`) is part of; None for any other."""
        ...

    def part_names(self, layer: str) -> tuple[str, ...]:
        """Every tensor of `layer`'s quantized weight, in the order `dequantize` takes them."""
        ...

    def dropped(self, name: str) -> bool:
        """A tensor of this format that is read and dropped (static activation scales: activations stay unquantized)."""
        ...

    def dequantize(self, parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """The layer's weight [out_features, in_features] in `dtype`, from its parts."""
        ...


@runtime_checkable
class KeptFormat(Protocol):
    """A format whose quantized weights layers can keep as stored, where the platform runs the format's op."""

    def kept_by(self, ops: Ops) -> bool:
        """Whether a platform of this op table runs the format's op (`fp8_linear`, `int4_linear`) on the weights."""
        ...

    def quantized_of(self) -> QuantizedOf:
        """Which linear layers keep the weights quantized (by the HF modules each fuses), and in which layout."""
        ...


# quant_method -> the parser of its config; each raises ModelLoadError naming what it supports.
_FORMATS = {
    "fp8": Fp8Format.from_config,
    "compressed-tensors": compressed_tensors.from_config,
    "awq": AwqFormat.from_config,
    "gptq": GptqFormat.from_config,
}


def loading_summary(
    fp8_kernel: bool, int4_kernel: bool = False, fp8_experts: bool = False, int4_experts: bool = False
) -> str:
    """What `omnirun env` says of quantized checkpoints on a device that does or does not run `fp8_linear`
    (`fp8_kernel`), `int4_linear` (`int4_kernel`), `fp8_fused_moe` (`fp8_experts`) and `int4_fused_moe`
    (`int4_experts`)."""
    kept = [
        what
        for what, runs in (
            ("fp8 weights kept in fp8 for fp8_linear", fp8_kernel),
            ("fp8 experts kept in fp8 for fp8_fused_moe", fp8_experts),
            ("awq/gptq/w4a16 4-bit weights kept packed for int4_linear", int4_kernel),
            ("awq/gptq/w4a16 4-bit experts kept packed for int4_fused_moe", int4_experts),
        )
        if runs
    ]
    if not kept:
        return f"{', '.join(_FORMATS)} checkpoints, dequantized to the model dtype at load"
    return f"{', '.join(_FORMATS)} checkpoints; {', '.join(kept)}, the others dequantized to the model dtype at load"


def quantized_format(config: Any) -> QuantizedFormat | None:
    """The format of a checkpoint whose transformers config is `config`; None for an unquantized one."""
    quantization = getattr(config, "quantization_config", None)
    if quantization is None:
        return None
    if not isinstance(quantization, dict):
        quantization = quantization.to_dict()  # a transformers QuantizationConfigMixin
    method = quantization.get("quant_method")
    parse = _FORMATS.get(method)
    if parse is None:
        raise ModelLoadError(
            f"the checkpoint's quantization_config has quant_method {method!r}, which omnirun cannot load yet "
            f"(supported: {', '.join(_FORMATS)}): use an unquantized or {'/'.join(_FORMATS)} checkpoint"
        )
    return parse(quantization)
