"""Dequantizing at load: a checkpoint's stream of tensors with each quantized weight joined to its scales and turned
into the model's dtype, so the model loads it as it loads any weight. Tensors a format reads and drops (activation
scales, when activations are not quantized) are dropped here."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from omnirun.errors import ModelLoadError
from omnirun.quantization.formats import QuantizedFormat


def dequantized(
    tensors: Iterable[tuple[str, Any]], fmt: QuantizedFormat, dtype: torch.dtype
) -> Iterator[tuple[str, Any]]:
    """(name, tensor) of `tensors` with every quantized weight (a one-byte float `.weight`) in `dtype`. A weight
    and its scales wait for each other wherever in the stream they come; one left waiting at the end is an error."""
    waiting: dict[str, torch.Tensor] = {}  # quantized weights and scales read whole, not joined yet
    for name, source in tensors:
        layer_weight = f"{name.rsplit('.', 1)[0]}.weight"  # the weight a scale of this name would belong to
        quantized_weight = name.endswith(".weight") and source.dtype.is_floating_point and source.dtype.itemsize == 1
        if name in fmt.extra_names(layer_weight):
            continue
        if not quantized_weight and name not in fmt.scale_names(layer_weight):
            yield name, source
            continue
        # Read whole now: a lazy tensor is valid only until the stream moves on.
        waiting[name] = source if isinstance(source, torch.Tensor) else source.read()
        weight = name if quantized_weight else layer_weight
        scales = fmt.scale_names(weight)
        if weight in waiting and all(scale in waiting for scale in scales):
            yield weight, fmt.dequantize(waiting.pop(weight), [waiting.pop(scale) for scale in scales], dtype)
    if waiting:
        name = sorted(waiting)[0]
        lacks = fmt.scale_names(name)[0] if name.endswith(".weight") else f"{name.rsplit('.', 1)[0]}.weight"
        raise ModelLoadError(
            f"the {fmt.describe()} checkpoint has {name} but no {lacks}: re-download or re-save the checkpoint"
        )
