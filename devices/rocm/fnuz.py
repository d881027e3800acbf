"""fp8 checkpoints (OCP float8_e4m3fn) in the encoding an MI300 computes in (float8_e4m3fnuz), without a rounding.

The two encodings share their bits but not their exponent bias: fnuz's is one higher, so every bit pattern stands for
half the value it has in e4m3fn (subnormals included). Reading the same bits as fnuz and doubling the scale gives back
each weight exactly. One pattern differs in kind: 0x80 is e4m3fn's negative zero but fnuz's only NaN, so it becomes
0x00. vLLM and SGLang convert the same way (vllm-project/vllm: vllm/model_executor/layers/quantization/utils/
w8a8_utils.py::normalize_e4m3fn_to_e4m3fnuz; sgl-project/sglang: python/sglang/srt/layers/quantization/
fp8_utils.py::normalize_e4m3fn_to_e4m3fnuz). e4m3fn's NaNs (0x7F, 0xFF) would read as +-240: a checkpoint holds none.
"""

from __future__ import annotations

import torch

NEGATIVE_ZERO = 0x80  # e4m3fn: -0.0; e4m3fnuz: NaN


def e4m3fn_as_fnuz(weight: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fnuz weight, float32 scale) standing for the same values as the e4m3fn `weight` times `scale`:
    new tensors (the loaded ones stay as they are)."""
    if weight.dtype != torch.float8_e4m3fn:
        raise TypeError(f"expected a float8_e4m3fn weight, got {weight.dtype}")
    bits = weight.contiguous().view(torch.uint8)
    bits = torch.where(bits == NEGATIVE_ZERO, torch.zeros_like(bits), bits)
    return bits.view(torch.float8_e4m3fnuz), scale.float() * 2.0
