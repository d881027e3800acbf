"""torch_npu's weight-only quantized matmul as omnirun's `int4_linear` (AWQ/GPTQ 4-bit layers kept packed).

The kernel is npu_weight_quant_batchmatmul(x [M, K], weight [K, N], antiquant_scale, antiquant_offset, ...,
bias, antiquant_group_size) computing y = x @ ((weight + antiquant_offset) * antiquant_scale) + bias, with a 4-bit
weight carried as int32 [K, N / 8] made by npu_convert_weight_to_int4pack from int32 values in [-8, 7]
(Ascend/op-plugin docs/zh/custom_APIs/torch_npu/torch_npu-npu_weight_quant_batchmatmul.md and
-npu_convert_weight_to_int4pack.md). Our layers keep W[n, k] = (q - zero) * scale with q in [0, 15]; with the signed
q - 8 the kernel wants, the same weight is ((q - 8) + (8 - zero)) * scale: offset = 8 - zero, as vllm-ascend's AWQ
method turns qzeros into antiquant_offset = -(zero - 8) (vllm-project/vllm-ascend
vllm_ascend/quantization/awq/awq.py, AWQLinearAscendMethod).

fp8 checkpoints get no `fp8_linear` here, so they are dequantized at load. Atlas A2/A3 take no fp8 weight at all (the
aclnn doc marks FLOAT8_E4M3FN "not supported" there: hicann/ops-nn
matmul/weight_quant_batch_matmul_v2/docs/aclnnWeightQuantBatchMatmulV2_en.md); Ascend 950 takes one per output
channel only ("C quantization"), not the per-block scales most fp8 checkpoints carry, and torch_npu's own doc lists
no 950 for this API. Offering `fp8_linear` keeps every fp8 layer, so block-scaled ones would run the reference,
dequantizing on each call. W8A8 (npu_dynamic_quant + npu_quant_matmul) would requantize fp8 weights and bf16
activations to int8: another format, whose error this op table cannot state, so it is not offered either.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from omnirun.attention.backend import HALF_DTYPES
from omnirun.layers import native_ops
from omnirun.layers.prepared import loaded_on

INT4_KERNELS = ("npu_convert_weight_to_int4pack", "npu_weight_quant_batchmatmul")
# Where int32-carried int4 weights and per-group scales run: Atlas A2 (Ascend910B*), A3 (Ascend910_93*) in torch_npu's
# doc, and Ascend 950 in the kernel's (aclnnWeightQuantBatchMatmulV2_en.md, "A16W4": INT32, ND, pergroup). Atlas
# inference cards (310P) take int8 weights only.
INT4_SOCS = ("Ascend910B", "Ascend910_93", "Ascend950")
DIM_LIMIT = 65535  # K and N within [1, 65535] on A2/A3 (the doc's constraints)
GROUP_STEP = 32  # antiquant_group_size: 0 (one group), or a multiple of 32 within [32, K - 1]


@dataclasses.dataclass(frozen=True)
class AscendInt4Weight:
    """A kept int4 weight in the kernel's form: `weight` int32 [K, N / 8] (npu_convert_weight_to_int4pack of the
    signed values, laid [K, N]), and per model dtype the (scale, offset) pair [groups, N] in that dtype (the kernel
    wants them in x's dtype; both halves are made once so that no call casts, at the cost float32 ones would have);
    offset None where every zero point is 8 (GPTQ's symmetric checkpoints)."""

    weight: torch.Tensor
    antiquant: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor | None]]
    group_size: int  # antiquant_group_size: 0 for one group per row (per-channel mode)
    # The kernel reads this form alone: the loaded words wait in host memory (omnirun.layers.prepared).
    reads_loaded_tensors: ClassVar[bool] = False


def _kernel_group_size(out_features: int, in_features: int, group_size: int) -> int | None:
    """antiquant_group_size for a layer of these dimensions and groups, None where the kernel does not take it."""
    # npu_convert_weight_to_int4pack packs the last dimension (N of [K, N]) by 8.
    if out_features % 8 or max(in_features, out_features) > DIM_LIMIT:
        return None
    if -(-in_features // group_size) == 1:
        return 0  # per channel: scale (1, N)
    if group_size % GROUP_STEP:
        return None
    return group_size  # groups > 1: group_size < K, within [32, K - 1]


def ascend_int4_ops(torch_npu: Any, soc: str) -> dict[str, Callable[..., Any]]:
    """`int4_linear` and its `prepare_int4_linear` where this torch_npu has the kernels and the SoC runs them."""
    if not soc.startswith(INT4_SOCS) or not all(hasattr(torch_npu, name) for name in INT4_KERNELS):
        return {}

    def prepare_int4_linear(
        weight_packed: torch.Tensor, weight_scale: torch.Tensor, weight_zero_point: torch.Tensor, group_size: int
    ) -> AscendInt4Weight | None:
        kernel_group = _kernel_group_size(weight_packed.shape[0], weight_packed.shape[1] * 8, group_size)
        if kernel_group is None:
            return None  # the reference runs this layer (int4_linear_takes declines it: never kept)
        # Unpacked, signed, laid [K, N] and repacked by the vendor, as vllm-ascend re-lays compressed-tensors' words,
        # our layout (vllm_ascend/quantization/kernels/mixed_precision/npu.py, AscendwNa16LinearKernel).
        signed = (native_ops.unpack_int4_rows(weight_packed) - 8).t().contiguous()  # int32 [K, N] in [-8, 7]
        weight = torch_npu.npu_convert_weight_to_int4pack(signed)
        scale = weight_scale.t()
        symmetric = bool((weight_zero_point == 8).all())
        offset = None if symmetric else 8 - weight_zero_point.t().float()
        antiquant = {
            dtype: (scale.to(dtype).contiguous(), None if offset is None else offset.to(dtype).contiguous())
            for dtype in HALF_DTYPES
        }
        return AscendInt4Weight(weight, antiquant, kernel_group)

    def int4_linear(
        x: torch.Tensor,
        weight_packed: torch.Tensor,
        weight_scale: torch.Tensor,
        weight_zero_point: torch.Tensor,
        bias: torch.Tensor | None,
        group_size: int,
        prepared: AscendInt4Weight | None = None,
    ) -> torch.Tensor:
        # The kernel takes float16/bfloat16 x and no empty tensor; shape checks only, so it runs inside graphs.
        if prepared is None or x.dtype not in HALF_DTYPES or x.numel() == 0:
            loaded = loaded_on(x.device, weight_packed, weight_scale, weight_zero_point)
            return native_ops.int4_linear(x, *loaded, bias, group_size)
        scale, offset = prepared.antiquant[x.dtype]
        if bias is not None:  # the doc: bias float32 for bfloat16 x, float16 for float16 x
            bias = bias.to(torch.float32 if x.dtype == torch.bfloat16 else torch.float16)
        out = torch_npu.npu_weight_quant_batchmatmul(
            x.reshape(-1, x.shape[-1]).contiguous(),
            prepared.weight,
            scale,
            offset,
            bias=bias,
            antiquant_group_size=prepared.group_size,
        )
        return out.view(*x.shape[:-1], out.shape[-1])

    def int4_linear_takes(n: int, k: int, group_size: int, dtype: torch.dtype) -> bool:
        # What prepare_int4_linear makes a kernel form of, in the dtypes the kernel computes: the rest is dequantized
        # at load rather than run the reference, which dequantizes at every call.
        return dtype in HALF_DTYPES and _kernel_group_size(n, k, group_size) is not None

    return {
        "int4_linear": int4_linear,
        "prepare_int4_linear": prepare_int4_linear,
        "int4_linear_takes": int4_linear_takes,
    }
