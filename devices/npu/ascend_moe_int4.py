"""omnirun's `int4_fused_moe` (AWQ/GPTQ experts kept packed) on Ascend: the MoE kernels of ascend_moe.py with
torch_npu's grouped matmul in its antiquant (W4A16) mode, as SGLang calls it for AWQ experts on NPU
(sgl-project/sglang python/sglang/srt/layers/quantization/awq.py, AWQMoEAscendMethod, and w8a8_int8.py,
npu_fused_experts with use_wna16) and vllm-ascend for W4A16 experts.

The kernel (Ascend/op-plugin docs/context/torch_npu-npu_grouped_matmul.md, "伪量化", formula 4): y_g = x_g @
((w_g + antiquant_offset_g) * antiquant_scale_g) for the rows of each group g, with, on Atlas A2/A3 and a Tensor
group_list, a single x [M, K] in float16/bfloat16, a single int4 weight [E, K, N] carried as int32 [E, K, N / 8]
("当前PyTorch不支持int4类型数据 ... 使用int32数据表示int4"), antiquant_scale and antiquant_offset in x's dtype shaped
[E, G, N] per group or [E, N] per channel, G dividing K, N even, K and N below 65536, at most 1,024 groups.

Our experts keep each projection's rows as int4_linear does: int32 [n, N, K / 8] of unsigned q, float32 scales and
uint8 zero points [n, N, G], W = (q - zero) * scale. `prepare_int4_fused_moe` re-lays them once (after loading and
after each weight update) in the kernel's form, one expert at a time (the int32 values of one expert are the largest
temporary): q - 8 in [-8, 7] laid [K, N] and packed by npu_convert_weight_to_int4pack (the same packing SGLang
writes by hand: eight consecutive outputs a word, the lowest bits first, two's complement), the scales [n, G, N] and
the offsets 8 - zero (exact in either dtype), as vllm-ascend's AWQ method turns qzeros into antiquant_offset (see
ascend_quant.py). Scales and offsets are made in both half dtypes, so no call casts. The loaded tensors stay (weight
updates and get_weights_by_name read them): the kept experts take their int4 bytes twice on the device.

What takes the reference (omnirun.layers.native_ops.int4_fused_moe, dequantizing the experts at every call): experts
prepare declined (None: groups that do not divide a projection's inputs, outputs not a multiple of 8, dimensions of
65536 or more), and calls the routing kernels or the grouped matmul do not take (ascend_moe.py's limits; x other than
float16/bfloat16). Real AWQ mixtures (Qwen3-30B-A3B, Qwen2-MoE, Mixtral: groups of 128, dimensions multiples of 128)
are all taken.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from omnirun.attention.backend import HALF_DTYPES
from omnirun.devices.npu.ascend_moe import GROUPS_MAX, INNER_LIMIT, MOE_KERNELS, routed_experts, takes_routing
from omnirun.layers import native_ops
from omnirun.layers.prepared import loaded_on

# The MoE kernels and the vendor's int4 packing.
INT4_MOE_KERNELS = (*MOE_KERNELS, "npu_convert_weight_to_int4pack")
# npu_grouped_matmul's int4 weights: Atlas A2 (Ascend910B*) and A3 (Ascend910_93*) in its doc; 310P takes float16
# weights only.
INT4_MOE_SOCS = ("Ascend910B", "Ascend910_93")


@dataclasses.dataclass(frozen=True)
class AscendInt4Projection:
    """One projection of every local expert in the kernel's form: `weight` int32 [n, K, N / 8], and per half dtype
    (antiquant_scale, antiquant_offset), each [n, G, N], or [n, N] for one group over K (per channel)."""

    weight: torch.Tensor
    antiquant: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]]


@dataclasses.dataclass(frozen=True)
class AscendInt4Experts:
    w13: AscendInt4Projection
    w2: AscendInt4Projection
    # The kernel reads this form alone: the loaded words wait in host memory (omnirun.layers.prepared).
    reads_loaded_tensors: ClassVar[bool] = False


def _projection(
    torch_npu: Any, packed: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor
) -> AscendInt4Projection:
    experts, outputs, words = packed.shape
    weight = packed.new_empty(experts, words * 8, outputs // 8)
    for e in range(experts):  # one expert's int32 values at a time
        signed = (native_ops.unpack_int4_rows(packed[e]) - 8).t().contiguous()  # [K, N] in [-8, 7]
        weight[e] = torch_npu.npu_convert_weight_to_int4pack(signed)
    per_channel = scale.shape[-1] == 1
    scale, offset = scale.transpose(1, 2), 8 - zero_point.transpose(1, 2).float()  # [n, G, N]
    if per_channel:
        scale, offset = scale[:, 0], offset[:, 0]  # [n, N]
    antiquant = {dtype: (scale.to(dtype).contiguous(), offset.to(dtype).contiguous()) for dtype in HALF_DTYPES}
    return AscendInt4Projection(weight, antiquant)


def _kernel_takes(packed: torch.Tensor, scale: torch.Tensor, group_size: int) -> bool:
    """Whether the grouped matmul takes this projection ([n, N, K / 8] words, [n, N, G] scales): one group over K
    (per channel) or whole groups (the kernel reads group g as inputs g K / G .. (g + 1) K / G), N a multiple of 8
    (whole words once laid [K, N]), both below the kernel's inner limit."""
    experts, outputs, words = packed.shape
    inputs = words * 8
    whole = scale.shape[-1] == 1 or inputs % group_size == 0
    return whole and outputs % 8 == 0 and 0 < experts <= GROUPS_MAX and max(inputs, outputs) < INNER_LIMIT


def ascend_int4_moe_ops(torch_npu: Any, soc: str) -> dict[str, Callable[..., Any]]:
    """`int4_fused_moe` and its `prepare_int4_fused_moe` where this torch_npu has the kernels and the SoC runs them."""
    if not soc.startswith(INT4_MOE_SOCS) or not all(hasattr(torch_npu, name) for name in INT4_MOE_KERNELS):
        return {}

    def prepare_int4_fused_moe(
        w13_packed: torch.Tensor,
        w13_scale: torch.Tensor,
        w13_zero_point: torch.Tensor,
        w2_packed: torch.Tensor,
        w2_scale: torch.Tensor,
        w2_zero_point: torch.Tensor,
        group_size: int,
    ) -> AscendInt4Experts | None:
        if not (_kernel_takes(w13_packed, w13_scale, group_size) and _kernel_takes(w2_packed, w2_scale, group_size)):
            return None  # the reference runs these experts
        return AscendInt4Experts(
            _projection(torch_npu, w13_packed, w13_scale, w13_zero_point),
            _projection(torch_npu, w2_packed, w2_scale, w2_zero_point),
        )

    def grouped_matmul(rows: torch.Tensor, projection: AscendInt4Projection, counts: torch.Tensor) -> torch.Tensor:
        scale, offset = projection.antiquant[rows.dtype]
        return torch_npu.npu_grouped_matmul(
            x=[rows],
            weight=[projection.weight],
            antiquant_scale=[scale],
            antiquant_offset=[offset],
            split_item=2,
            group_list_type=0,
            group_type=0,
            group_list=counts,
            output_dtype=rows.dtype,
        )[0]

    def int4_fused_moe(
        x: torch.Tensor,
        router_logits: torch.Tensor,
        w13_packed: torch.Tensor,
        w13_scale: torch.Tensor,
        w13_zero_point: torch.Tensor,
        w2_packed: torch.Tensor,
        w2_scale: torch.Tensor,
        w2_zero_point: torch.Tensor,
        top_k: int,
        renormalize: bool,
        expert_start: int = 0,
        group_size: int = 128,
        prepared: AscendInt4Experts | None = None,
    ) -> torch.Tensor:
        local = w13_packed.shape[0]
        if prepared is None or x.dtype not in HALF_DTYPES or not takes_routing(x, router_logits, local, top_k):
            loaded = loaded_on(x.device, w13_packed, w13_scale, w13_zero_point, w2_packed, w2_scale, w2_zero_point)
            return native_ops.int4_fused_moe(x, router_logits, *loaded, top_k, renormalize, expert_start, group_size)
        return routed_experts(
            torch_npu,
            x,
            router_logits,
            local,
            top_k,
            renormalize,
            expert_start,
            lambda rows, counts: grouped_matmul(rows, prepared.w13, counts),
            lambda rows, counts: grouped_matmul(rows, prepared.w2, counts),
        )

    return {"int4_fused_moe": int4_fused_moe, "prepare_int4_fused_moe": prepare_int4_fused_moe}
