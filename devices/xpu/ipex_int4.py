"""xpu's `int4_linear` (W4A16: AWQ and GPTQ checkpoints) on IPEX's weight-only-quantized linear, called as vLLM calls
it on XPU for AWQ (vllm-project/vllm: vllm/model_executor/layers/quantization/ipex_quant.py::IPEXAWQLinearMethod).

IPEX (intel/intel-extension-for-pytorch, read at tags v2.8.10+xpu and v2.5.10+xpu; v2.10.10+xpu has v2.8.10's code):
- `ipex.llm.quantization.IPEXWeightOnlyQuantizedLinear.from_weight(qweight, scales, zero_points, in_features,
  out_features, qconfig=None, bias=None, group_size=-1, g_idx=None, quant_method=QuantMethod.GPTQ_GEMM,
  dtype=QuantDtype.INT4)` (llm/quantization/woq_linear.py) builds the XPU module of nn/utils/_quantize_convert.py.
  With `QuantMethod.AWQ_GEMM` it takes AutoAWQ's checkpoint layout: qweight int32 [K, N / 8] packed along N,
  nibble i of word j holding output 8j + AWQ_ORDER[i]; zero points int32 [groups, N / 8] packed alike, the zeros
  themselves; scales [groups, N], float16 or float32. It repacks them for its kernel in the tensors it is given
  (`qweight.data.copy_(...)`), so it gets tensors made here, never the layer's. The GPTQ method is no use: it
  treats every GPTQ weight as symmetric and drops its zero points (set_scales_zps_gidx).
- Its forward(x) runs oneDNN's int4 matmul, or XeTLA's (`torch_ipex.mm_int4`, or int4x8_dequantize + mm_common for
  several rows) where IPEX picks XeTLA (xpu_gemm_use_xetla: GPUs without XMX or 2D block loads). A bias passed to
  forward is ignored for int4: ours is added after. (v2.5.10 always takes XeTLA, and sets it as torch.xpu's compute
  engine for the process.)

What it is given (else the platform's fallback, the portable Triton kernel; a layer neither takes is dequantized at
load, `int4_linear_takes`; a scale float16 cannot hold, known only once loaded, runs the fallback or the reference):
- bfloat16 or float16 rows: XeTLA computes float32 rows in half (XEGEMM_INT4.cpp: `input.to(kHalf)`).
- Group sizes XeTLA has kernels for, dividing K (XEGEMM_INT4.h: supported_gzs; XeInt4Dequantize.h: "reduce-dim
  must be divisible by group size"; oneDNN counts k / group_size groups), K a multiple of 128 (the smallest k tile
  of XeTLA's GEMV configs, ordered_config_set), N a multiple of 8 (AWQ packs 8 outputs a word).
- Scales that float16 holds to its own precision: XeTLA reads them in float16 (transpose_xetla_woq_format), as vLLM
  passes AWQ's float16 checkpoint scales; a scale float16 cannot hold (subnormal, too large) takes the fallback.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import torch

from omnirun.layers import native_ops
from omnirun.layers.prepared import loaded_on

HALF = (torch.bfloat16, torch.float16)
GROUP_SIZES = (32, 64, 128, 256, 512, 1024)  # XeTLA's GEMV (0 = per channel, 32..1024); its dequantizer adds 16
K_TILE = 128  # XeTLA's GEMV configs step K by 512, 256 or 128 and take only a K they divide
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ: nibble i of word j holds column 8j + AWQ_ORDER[i]


@dataclasses.dataclass(frozen=True)
class IpexInt4:
    """A layer's weight as IPEX's module holds it (its own repacked copy of the words)."""

    linear: Any  # ipex.llm.quantization.IPEXWeightOnlyQuantizedLinear
    out_features: int
    # IPEX's module reads its own copy alone: the loaded words wait in host memory (omnirun.layers.prepared).
    reads_loaded_tensors: ClassVar[bool] = False


def offers_int4(ipex: Any) -> bool:
    """Whether this IPEX has the weight-only-quantized linear with the AWQ method (v2.5.10+xpu and later)."""
    quantization = getattr(ipex.llm, "quantization", None)
    method = getattr(quantization, "QuantMethod", None)
    return hasattr(quantization, "IPEXWeightOnlyQuantizedLinear") and hasattr(method, "AWQ_GEMM")


def ipex_takes(out_features: int, in_features: int, group_size: int) -> bool:
    """Whether IPEX's kernels take a weight of this shape and group size (module docstring)."""
    return (
        group_size in GROUP_SIZES
        and in_features % group_size == 0
        and in_features % K_TILE == 0
        and out_features % 8 == 0
    )


def _half_holds(scale: torch.Tensor) -> bool:
    """float16 keeps each scale to its own relative precision: no overflow, no subnormal rounding (exact ones pass)."""
    rounded = scale.to(torch.float16).float()
    error = (rounded - scale).abs()
    return bool(torch.isfinite(rounded).all() and (error <= scale.abs() * 2.0**-11).all())


def awq_words(values: torch.Tensor) -> torch.Tensor:
    """4-bit values int [R, C] -> int32 [R, C / 8] in AWQ's packing (AWQ_ORDER within each word of 8 columns)."""
    fields = values.to(torch.int64).view(values.shape[0], -1, 8)[:, :, list(AWQ_ORDER)]
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=values.device)
    words = (fields << shifts).sum(-1)  # nibbles of 0..15 at distinct shifts: the sum is their bitwise or
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # as two's complement int32


def ipex_int4_ops(ipex: Any, fallback: Mapping[str, Callable[..., Any]]) -> dict[str, Callable[..., Any]]:
    """`int4_linear` and `prepare_int4_linear` on this IPEX (offers_int4 said it has them)."""
    quantization = ipex.llm.quantization
    plain = fallback.get("int4_linear", native_ops.int4_linear)

    def prepare_int4_linear(
        weight_packed: torch.Tensor, weight_scale: torch.Tensor, weight_zero_point: torch.Tensor, group_size: int
    ) -> IpexInt4 | None:
        # Made once after loading and after each weight update (host reads are fine here); None: the fallback.
        out_features, in_features = weight_packed.shape[0], weight_packed.shape[1] * 8
        if not ipex_takes(out_features, in_features, group_size) or not _half_holds(weight_scale):
            return None
        # Ours: [N, K / 8] words along K. AWQ's: [K, N / 8] words along N, its zero points [groups, N / 8] alike.
        qweight = awq_words(native_ops.unpack_int4_rows(weight_packed).t())
        qzeros = awq_words(weight_zero_point.t())
        scales = weight_scale.t().contiguous().to(torch.float16)
        linear = quantization.IPEXWeightOnlyQuantizedLinear.from_weight(
            qweight,
            scales,
            qzeros,
            in_features,
            out_features,
            qconfig=None,
            bias=None,
            group_size=group_size,
            g_idx=None,
            quant_method=quantization.QuantMethod.AWQ_GEMM,
            dtype=quantization.QuantDtype.INT4,
        )
        return IpexInt4(linear, out_features)

    def int4_linear(
        x: torch.Tensor,
        weight_packed: torch.Tensor,
        weight_scale: torch.Tensor,
        weight_zero_point: torch.Tensor,
        bias: torch.Tensor | None,
        group_size: int,
        prepared: Any = None,
    ) -> torch.Tensor:
        if not isinstance(prepared, IpexInt4) or x.dtype not in HALF:
            return plain(x, *loaded_on(x.device, weight_packed, weight_scale, weight_zero_point), bias, group_size)
        out = prepared.linear(x.reshape(-1, x.shape[-1]).contiguous())  # [M, N] in x's dtype
        if bias is not None:
            out = out + bias
        return out.view(*x.shape[:-1], prepared.out_features)

    fallback_takes = fallback.get("int4_linear_takes") if "int4_linear" in fallback else None

    def int4_linear_takes(n: int, k: int, group_size: int, dtype: torch.dtype) -> bool:
        # IPEX's shapes in bf16/fp16, else what the fallback kernel takes; the reference alone takes nothing (a
        # layer it would run is dequantized at load instead).
        ipex = dtype in (torch.bfloat16, torch.float16) and ipex_takes(n, k, group_size)
        return ipex or (fallback_takes is not None and fallback_takes(n, k, group_size, dtype))

    return {
        "int4_linear": int4_linear,
        "prepare_int4_linear": prepare_int4_linear,
        "int4_linear_takes": int4_linear_takes,
    }
