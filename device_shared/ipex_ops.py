"""IPEX's fused kernels as omnirun's fused ops (ipex.llm.functional), shared by the xpu and cpu platforms.

What each build has (intel/intel-extension-for-pytorch, llm/functional/fusions.py and utils.py):
- XPU build (v2.8.10+xpu): rms_norm, add_rms_norm, silu_and_mul and rotary_embedding_batched, all on XPU kernels
  (transformers/models/xpu/fusions/activation_fusion.py, csrc/gpu/aten/operators/{RMSNorm,AddNormFusion,Rope}.cpp).
- CPU build (v2.8.0+cpu): rms_norm and add_rms_norm on torch_ipex kernels; its silu_mul is plain torch
  (silu(x) * y) and it has no rotary_embedding_batched, so neither is offered.

Every call IPEX would not take (another dtype, a weight of another dtype, a head dim its rope kernel lacks) goes to
the fallback the platform hands over (the portable Triton kernel where triton runs, else the torch-native
reference). The checks read only shapes and dtypes, so the ops run inside graphs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal

import torch

from omnirun.layers import native_ops

Build = Literal["xpu", "cpu"]
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# torch_ipex::rotary_embedding instantiates these rotary dims only, and needs rotary_dim == head_size (Rope.cpp).
ROPE_HEAD_DIMS = (32, 64, 96, 128, 256)


def _norm_takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return x.dtype in KERNEL_DTYPES and weight.dtype == x.dtype and weight.dim() == 1 and x.shape[-1] == weight.numel()


def ipex_fused_ops(build: Build, fallback: Mapping[str, Callable[..., Any]]) -> dict[str, Callable[..., Any]]:
    """The fused ops of one IPEX build (IPEX is imported here, when the platform builds its op table)."""
    import intel_extension_for_pytorch as ipex

    functional = ipex.llm.functional
    plain = {name: fallback.get(name, getattr(native_ops, name)) for name in ("rms_norm", "add_rms_norm")}

    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if not _norm_takes(x, weight):
            return plain["rms_norm"](x, weight, eps)
        # ipex.llm.functional.rms_norm(hidden_states, weight, eps) -> a new tensor in x's dtype (fusions.py).
        return functional.rms_norm(x.contiguous(), weight, eps)

    def add_rms_norm(
        x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not _norm_takes(x, weight) or residual.dtype != x.dtype or residual.shape != x.shape:
            return plain["add_rms_norm"](x, residual, weight, eps)
        # add_rms_norm(residual, x, weight, bias, eps, add_back) returns rms_norm(x + residual) and, with add_back,
        # writes x + residual into `residual` (bias None: the CPU build refuses one). The caller's residual is not
        # ours to overwrite, so the sum goes into a copy (as vllm/_ipex_ops.py::fused_add_rms_norm, out of place).
        summed = residual.contiguous().clone()
        out = functional.add_rms_norm(summed, x.contiguous(), weight, None, eps, True)
        return out, summed

    ops: dict[str, Callable[..., Any]] = {"rms_norm": rms_norm, "add_rms_norm": add_rms_norm}
    if build == "xpu":
        ops.update(_xpu_ops(functional, fallback))
    return ops


def _xpu_ops(functional: Any, fallback: Mapping[str, Callable[..., Any]]) -> dict[str, Callable[..., Any]]:
    plain_silu = fallback.get("silu_and_mul", native_ops.silu_and_mul)
    plain_rope = fallback.get("rotary_embedding", native_ops.rotary_embedding)
    tables: dict[tuple[int, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in KERNEL_DTYPES or x.shape[-1] % 2:
            return plain_silu(x)
        out = x.new_empty((*x.shape[:-1], x.shape[-1] // 2))
        # silu_and_mul(x, out): out = silu(x[..., :d]) * x[..., d:]. `out` is always passed: without it the XPU
        # build computes the output shape from x.size(-1) / 2, a float (activation_fusion.py::silu_and_mul_xpu).
        functional.silu_and_mul(x.contiguous(), out)
        return out

    def cos_sin_in(cache: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        # The kernel reads the table in q's dtype; the cast is made once per table (the model's warm-up runs make
        # it before any graph capture). HF casts cos/sin to the activation dtype too, so the values agree.
        key = (id(cache), dtype)
        if key not in tables or tables[key][0] is not cache:
            tables[key] = (cache, cache.to(dtype))
        return tables[key][1]

    def rotary_embedding(
        positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor, head_dim: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        takes = head_dim in ROPE_HEAD_DIMS and q.dtype in KERNEL_DTYPES and k.dtype == q.dtype and q.dim() == 2
        if not takes or cos_sin_cache.shape[-1] != head_dim:
            return plain_rope(positions, q, k, cos_sin_cache, head_dim)
        # In place on q and k, so copies of them: the caller's tensors stay as they were (the op is out of place).
        q_out = q.clone(memory_format=torch.contiguous_format)
        k_out = k.clone(memory_format=torch.contiguous_format)
        # rotary_embedding_batched(positions, query, key, head_dim, cos_sin_cache, is_nexo_style, rotary_dim):
        # [tokens, heads * head_dim] in place, int64 positions, cos_sin_cache [max_pos, rotary_dim] (cos half, then
        # sin half) in q's dtype; NeoX style is our layout (activation_fusion.py::rotary_embedding_batched_xpu;
        # called so by vllm-project/vllm@1a37f4fb: vllm/_ipex_ops.py::rotary_embedding).
        functional.rotary_embedding_batched(
            positions.to(torch.int64), q_out, k_out, head_dim, cos_sin_in(cos_sin_cache, q.dtype), True, head_dim
        )
        return q_out, k_out

    return {"silu_and_mul": silu_and_mul, "rotary_embedding": rotary_embedding}
