"""xpu's `fp8_linear` on IPEX's fp8 weight GEMM, called as vLLM calls it on XPU
(vllm-project/vllm: vllm/model_executor/layers/quantization/ipex_quant.py::XPUFp8LinearMethod.apply:
`torch.ops.torch_ipex.fp8_gemm_w8a16(x, weight, True, weight_scale, bias)`).

IPEX (intel/intel-extension-for-pytorch, v2.8.10+xpu to v2.10.10+xpu, csrc/gpu/aten/operators/fp8/FP8Linear.cpp and
csrc/gpu/oneDNN/DnnlMatmulQuant.h::dnnl_matmul_w8a16_fp8): `fp8_gemm_w8a16(A, B, trans_B, B_scale, bias)` -> A's
dtype. A bfloat16 or float16 [M, K] (any other dtype is an internal assert), B float8_e4m3fn or e5m2, [N, K] with
trans_B True; B_scale one scale for the whole weight (oneDNN's mask 0, "only for per-tensor scaling"; a longer tensor
would be read as its first element), float32/bfloat16/float16; bias [N]. The weights are decompressed exactly
(e4m3 fits bfloat16 and float16) and multiplied in oneDNN with float32 accumulation. It is not called through
IPEXWeightOnlyQuantizedLinear: that module guesses whether the weight is transposed from `shape[0] != in_features`,
wrong for square weights.

What it is given (`fp8_linear_takes`: bfloat16 models without blocks; the other layers are dequantized at load,
since the fallback would be the torch-native reference, the portable Triton fp8 kernel not being a portable op):
- per-row scales only, no blocks. A checkpoint's per-tensor scale (expanded to rows at load) goes in as B_scale. Rows
  of different scales (per-channel checkpoints, a fused q|k|v of several per-tensor scales) run with B_scale 1 and
  are scaled after, in float32: only in bfloat16, whose range holds the unscaled sums (float16's may not).
- bfloat16 or float16 rows, as above.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch

from omnirun.layers import native_ops

HALF = (torch.bfloat16, torch.float16)


@dataclasses.dataclass(frozen=True)
class IpexFp8:
    """The scale IPEX applies (float32 [1]) and, for rows of different scales, the per-row ones applied after."""

    scale: torch.Tensor
    per_row: torch.Tensor | None


def offers_fp8() -> bool:
    """Whether the imported IPEX registered its fp8 weight GEMM (v2.8.10+xpu and later)."""
    return hasattr(torch.ops.torch_ipex, "fp8_gemm_w8a16")


def ipex_fp8_ops(fallback: Mapping[str, Callable[..., Any]]) -> dict[str, Callable[..., Any]]:
    """`fp8_linear` and `prepare_fp8_linear` on IPEX's GEMM (offers_fp8 said it is there)."""
    plain = fallback.get("fp8_linear", native_ops.fp8_linear)

    def prepare_fp8_linear(
        weight: torch.Tensor, weight_scale: torch.Tensor, block: tuple[int, int] | None
    ) -> IpexFp8 | None:
        # Made once after loading and after each weight update: the host read of the scales is fine here.
        if block is not None or weight.dtype != torch.float8_e4m3fn:
            return None
        scales = weight_scale.float().reshape(-1)
        if bool((scales == scales[0]).all()):
            return IpexFp8(scales[:1].clone(), None)
        return IpexFp8(torch.ones(1, dtype=torch.float32, device=scales.device), scales.clone())

    def fp8_linear(
        x: torch.Tensor,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        bias: torch.Tensor | None,
        block: tuple[int, int] | None,
        prepared: Any = None,
    ) -> torch.Tensor:
        takes = isinstance(prepared, IpexFp8) and x.dtype in HALF
        if not takes or (prepared.per_row is not None and x.dtype != torch.bfloat16):
            return plain(x, weight, weight_scale, bias, block)
        rows = x.reshape(-1, x.shape[-1]).contiguous()  # oneDNN reads rows by their leading stride
        if prepared.per_row is None:
            out = torch.ops.torch_ipex.fp8_gemm_w8a16(rows, weight, True, prepared.scale, bias)
        else:
            out = torch.ops.torch_ipex.fp8_gemm_w8a16(rows, weight, True, prepared.scale, None).float()
            out = out * prepared.per_row if bias is None else torch.addcmul(bias.float(), out, prepared.per_row)
            out = out.to(x.dtype)
        return out.view(*x.shape[:-1], weight.shape[0])

    def fp8_linear_takes(n: int, k: int, block: tuple[int, int] | None, dtype: torch.dtype) -> bool:
        # IPEX's GEMM takes one scale per weight (per-row ones rescale its bf16 output): blocks, fp16 (whose per-row
        # scales go to the reference) and float32 models are dequantized at load instead.
        return block is None and dtype == torch.bfloat16

    return {"fp8_linear": fp8_linear, "prepare_fp8_linear": prepare_fp8_linear, "fp8_linear_takes": fp8_linear_takes}
