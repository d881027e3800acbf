"""Which quantized format a checkpoint is in, read from its config's `quantization_config`, and refused before any
weight is read when omnirun cannot load it."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from omnirun.errors import ModelLoadError
from omnirun.quantization import compressed_tensors
from omnirun.quantization.fp8 import Fp8Format


class QuantizedFormat(Protocol):
    """A checkpoint's quantized layout: which tensors carry a weight's scales, and the weight they make."""

    def describe(self) -> str: ...

    def scale_names(self, weight_name: str) -> tuple[str, ...]:
        """The checkpoint tensors a quantized `weight_name` needs beside itself (all of them, in order)."""
        ...

    def extra_names(self, weight_name: str) -> tuple[str, ...]:
        """Tensors of this format that are read and dropped (an activation scale, when weights are dequantized)."""
        ...

    def dequantize(self, weight: torch.Tensor, scales: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor: ...


# quant_method -> the parser of its config; each raises ModelLoadError naming what it supports.
_FORMATS = {"fp8": Fp8Format.from_config, "compressed-tensors": compressed_tensors.from_config}


def loading_summary() -> str:
    """What `omnirun env` says of quantized checkpoints: the same on every device until one has its own kernels."""
    return f"{', '.join(_FORMATS)} checkpoints, dequantized to the model dtype at load"


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
