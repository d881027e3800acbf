"""Dequantizing at load: a checkpoint's stream of tensors with each layer's quantized parts (an fp8 weight and its
scales; AWQ's or GPTQ's packed integers, zero points and scales) joined into `<layer>.weight` in the model's dtype,
so the model loads it as it loads any weight. Tensors a format reads and drops are dropped here."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from omnirun.errors import ModelLoadError
from omnirun.quantization.formats import QuantizedFormat


def dequantized(
    tensors: Iterable[tuple[str, Any]],
    fmt: QuantizedFormat,
    dtype: torch.dtype,
    keeps: Callable[[str], bool] = lambda layer: False,
    elsewhere: Callable[[str], bool] = lambda layer: False,
) -> Iterator[tuple[str, Any]]:
    """(name, tensor) of `tensors` with every layer's quantized parts replaced by its weight in `dtype`, or, for a
    layer that `keeps` its quantized weight (where the platform runs `fp8_linear` or `int4_linear`), by the
    parameters the layer holds (the format's `kept`: `<layer>.weight` and `.weight_scale` for fp8; `.weight_packed`,
    `.weight_scale` and `.weight_zero_point` for int4). A layer's parts wait for each other
    wherever in the stream they come; a part left waiting at the end is an error. The parts of a layer held
    `elsewhere` (another rank's expert under expert parallelism) are dropped unread."""
    waiting: dict[str, tuple[str, torch.Tensor]] = {}  # part name -> (its layer, the part read whole)
    for name, source in tensors:
        if fmt.dropped(name):
            continue
        layer = fmt.layer_of(name, source.dtype)
        if layer is None:
            yield name, source
            continue
        if elsewhere(layer):
            continue
        # Read whole now: a lazy tensor is valid only until the stream moves on.
        waiting[name] = (layer, source if isinstance(source, torch.Tensor) else source.read())
        parts = fmt.part_names(layer)
        if all(part in waiting for part in parts):
            found = [waiting.pop(part)[1] for part in parts]
            if keeps(layer):
                for param, tensor in fmt.kept(found).items():
                    yield f"{layer}.{param}", tensor
            else:
                yield f"{layer}.weight", fmt.dequantize(found, dtype)
    if waiting:
        name = sorted(waiting)[0]
        missing = [part for part in fmt.part_names(waiting[name][0]) if part not in waiting]
        raise ModelLoadError(
            f"the {fmt.describe()} checkpoint has {name} but no {missing[0]}: re-download or re-save the checkpoint"
        )
