"""cuda's `fp8_linear`: the portable Triton kernels (omnirun.kernels.triton.fp8_linear) for decode-sized batches and
block-wise weights, and cuBLASLt's row-wise scaled fp8 GEMM (`torch._scaled_mm`) for per-row weight scales at
larger batches, with each token's activations quantized by one Triton launch.

`torch._scaled_mm(a, b, scale_a, scale_b, out_dtype=...)` takes a row-major fp8 `a` [M, K] and a column-major fp8
`b` [K, N] (a row-major [N, K] weight transposed is one), scales float32 [M, 1] and [1, N] for row-wise scaling
(sm89 and later), K and N multiples of 16 (torch's `_scaled_mm` checks; vLLM's cutlass_scaled_mm fallback calls it
the same way)."""

from __future__ import annotations

from typing import Any

import torch

from omnirun.kernels.triton import fp8_linear as triton_fp8


def _scaled_mm_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return x.shape[-1] % 16 == 0 and weight.shape[0] % 16 == 0 and weight.stride(1) == 1


def takes(out_features: int, in_features: int, block: tuple[int, int] | None, dtype: torch.dtype) -> bool:
    """`fp8_linear_takes`: bf16/fp16 models with blocks the Triton kernels take (the rest dequantize at load)."""
    return dtype in (torch.bfloat16, torch.float16) and triton_fp8.fits(block)


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    block: tuple[int, int] | None,
    prepared: Any = None,
) -> torch.Tensor:
    """The op table's `fp8_linear` (omnirun.layers.native_ops.fp8_linear's contract) on an NVIDIA GPU."""
    rows = x.reshape(-1, x.shape[-1])
    if (
        block is not None
        or rows.shape[0] <= triton_fp8.WEIGHT_ONLY_MAX_ROWS
        or x.dtype not in (torch.bfloat16, torch.float16)
        or not _scaled_mm_fits(x, weight)
    ):
        return triton_fp8.fp8_linear(x, weight, weight_scale, bias, block)
    q, x_scale = triton_fp8.quantize(rows if rows.stride(-1) == 1 else rows.contiguous())
    out = torch._scaled_mm(q, weight.t(), scale_a=x_scale, scale_b=weight_scale.view(1, -1), out_dtype=x.dtype)
    if bias is not None:
        out += bias
    return out.reshape(*x.shape[:-1], weight.shape[0])
