"""torch_npu's fused kernels as omnirun's ops: rms_norm, add_rms_norm, silu_and_mul, rotary_embedding, sample
(omnirun.devices.npu.ascend_sampling) and fused_moe (omnirun.devices.npu.ascend_moe). The quantized linears, which
also depend on the SoC, are omnirun.devices.npu.ascend_quant's.

Each op calls torch_npu where the documented constraints hold (Ascend/op-plugin:docs/zh/custom_APIs/torch_npu/)
and falls back to the torch-native reference otherwise. The checks read only shapes and dtypes, so they run inside
graphs. Rotary uses npu_rotary_mul, not ATB's _npu_rotary_embedding: that one keeps the cos/sin tables of its first
call in static globals (op-plugin op_plugin/ops/atb/RopeAtb.cpp), so a second model in the process would be wrong.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from omnirun.attention.backend import HALF_DTYPES
from omnirun.devices.npu.ascend_moe import MOE_KERNELS, ascend_fused_moe
from omnirun.layers import native_ops

# npu_rms_norm on Atlas A2/A3: (x, gamma) dtype pairs of its doc; npu_add_rms_norm: gamma in x's dtype.
_RMS_NORM_PAIRS = {
    (torch.float16, torch.float32),
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.float16),
    (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.float32),
}
_FLOATS = (*HALF_DTYPES, torch.float32)


def ascend_fused_ops(torch_npu: Any) -> dict[str, Callable[..., Any]]:
    """The ops whose torch_npu kernel this torch_npu has (older releases lack some)."""
    ops: dict[str, Callable[..., Any]] = {}

    if hasattr(torch_npu, "npu_rms_norm"):

        def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
            if (x.dtype, weight.dtype) not in _RMS_NORM_PAIRS or x.dim() < 2 or weight.shape != x.shape[-1:]:
                return native_ops.rms_norm(x, weight, eps)
            # npu_rms_norm(self, gamma, epsilon) -> (y, rstd); vllm-ascend ops/layernorm.py: x, _ = npu_rms_norm(..)
            return torch_npu.npu_rms_norm(x, weight, eps)[0]

        ops["rms_norm"] = rms_norm

    if hasattr(torch_npu, "npu_add_rms_norm"):

        def add_rms_norm(
            x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
        ) -> tuple[torch.Tensor, torch.Tensor]:
            if (
                x.dtype not in _FLOATS
                or residual.dtype != x.dtype
                or weight.dtype != x.dtype
                or x.shape != residual.shape
            ):
                return native_ops.add_rms_norm(x, residual, weight, eps)
            # npu_add_rms_norm(x1, x2, gamma, epsilon) -> (y, rstd, x1 + x2); vllm-ascend ops/layernorm.py:
            # x, _, residual = npu_add_rms_norm(x, residual, weight, eps)
            y, _, summed = torch_npu.npu_add_rms_norm(x, residual, weight, eps)
            return y, summed

        ops["add_rms_norm"] = add_rms_norm

    if hasattr(torch_npu, "npu_swiglu"):

        def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
            if x.dtype not in _FLOATS or x.shape[-1] % 2:
                return native_ops.silu_and_mul(x)
            # npu_swiglu(input, dim=-1): silu(first half) * second half, contiguous input
            # (vllm-ascend ops/activation.py::AscendSiluAndMul.forward_oot).
            return torch_npu.npu_swiglu(x.contiguous(), dim=-1)

        ops["silu_and_mul"] = silu_and_mul

    if hasattr(torch_npu, "npu_rotary_mul"):

        def rotary_embedding(
            positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor, head_dim: int
        ) -> tuple[torch.Tensor, torch.Tensor]:
            # The doc's half mode: D even and below 896; the table rotates the whole head.
            if q.dtype not in _FLOATS or head_dim % 2 or head_dim >= 896 or cos_sin_cache.shape[-1] != head_dim:
                return native_ops.rotary_embedding(positions, q, k, cos_sin_cache, head_dim)
            tokens = q.shape[0]
            cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)
            # As the reference: cos/sin over the full head ([f | f]) in the activation dtype, laid out 1S1D for
            # BSND inputs, as vllm-ascend ops/rotary_embedding.py::AscendApplyRotaryEmb.forward_oot builds them.
            cos = torch.cat((cos, cos), dim=-1).to(q.dtype).view(1, tokens, 1, head_dim)
            sin = torch.cat((sin, sin), dim=-1).to(q.dtype).view(1, tokens, 1, head_dim)

            def rotate(x: torch.Tensor) -> torch.Tensor:
                # npu_rotary_mul(input, r1, r2, rotary_mode='half') = x * r1 + rotate_half(x) * r2, out of place.
                return torch_npu.npu_rotary_mul(x.contiguous().view(1, tokens, -1, head_dim), cos, sin).view(tokens, -1)

            return rotate(q), rotate(k)

        ops["rotary_embedding"] = rotary_embedding

    if hasattr(torch_npu, "npu_top_k_top_p"):
        from omnirun.devices.npu.ascend_sampling import ascend_sample

        ops["sample"] = ascend_sample(torch_npu)

    if all(hasattr(torch_npu, name) for name in MOE_KERNELS):
        ops["fused_moe"] = ascend_fused_moe(torch_npu)

    return ops
