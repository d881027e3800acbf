"""aiter's rms norms as omnirun's fused ops `rms_norm` and `add_rms_norm`.

They are called on contiguous [rows, hidden] fp16/bf16 inputs with a weight of the input's dtype, as vLLM
(vllm-project/vllm:vllm/_aiter_ops.py) and SGLang (RMSNorm.forward_aiter) call them: aiter's fast HIP path covers
those (ROCm/aiter@e4048607a5 also takes fp32 through its opus kernels; older wheels may not). Every other call
(float32 models, a weight in another dtype) goes to the fallback the platform hands over: the portable Triton
kernel where triton runs, else the torch-native reference. The checks read only shapes and dtypes, so the ops run
inside graphs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from omnirun.attention.backend import HALF_DTYPES
from omnirun.layers import native_ops


def _aiter_takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return x.dtype in HALF_DTYPES and weight.dtype == x.dtype and x.dim() >= 1 and x.shape[-1] == weight.shape[-1]


def aiter_norm_ops(fallback: Mapping[str, Callable[..., Any]]) -> dict[str, Callable[..., Any]]:
    """{"rms_norm", "add_rms_norm"} on aiter (imported here, when the platform builds its op table)."""
    import aiter

    plain_norm = fallback.get("rms_norm", native_ops.rms_norm)
    plain_add_norm = fallback.get("add_rms_norm", native_ops.add_rms_norm)

    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if not _aiter_takes(x, weight):
            return plain_norm(x, weight, eps)
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        # ROCm/aiter:aiter/ops/rmsnorm.py::rms_norm(input, weight, epsilon, use_model_sensitive_rmsnorm=0) -> a
        # new tensor, called as vllm-project/vllm:vllm/_aiter_ops.py::_rocm_aiter_rms_norm_impl does.
        return aiter.rms_norm(rows, weight, eps).view(x.shape)

    def add_rms_norm(
        x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not _aiter_takes(x, weight) or residual.dtype != x.dtype or residual.shape != x.shape:
            return plain_add_norm(x, residual, weight, eps)
        rows_x = x.reshape(-1, x.shape[-1]).contiguous()
        rows_r = residual.reshape(-1, x.shape[-1]).contiguous()
        out, residual_out = torch.empty_like(rows_x), torch.empty_like(rows_r)
        # ROCm/aiter:aiter/ops/rmsnorm.py::rmsnorm2d_fwd_with_add(out, input, residual_in, residual_out, weight,
        # epsilon) writes out and residual_out = input + residual_in
        # (vllm-project/vllm:vllm/_aiter_ops.py::_rocm_aiter_rmsnorm2d_fwd_with_add_impl).
        aiter.rmsnorm2d_fwd_with_add(out, rows_x, rows_r, residual_out, weight, eps)
        return out.view(x.shape), residual_out.view(x.shape)

    return {"rms_norm": rms_norm, "add_rms_norm": add_rms_norm}
