"""Quantized checkpoints: which format a checkpoint's `quantization_config` names, and its weights in the model's
dtype. Today every device dequantizes once at load (issue 33's first step); per-device quantized kernels come
through the op table later."""

from omnirun.quantization.formats import KeptFormat, QuantizedFormat, quantized_format
from omnirun.quantization.on_load import dequantized

__all__ = ["KeptFormat", "QuantizedFormat", "dequantized", "quantized_format"]
