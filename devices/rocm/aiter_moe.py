"""aiter's fused MoE as omnirun's `fused_moe`, on request (OMNIRUN_ROCM_AITER_MOE=1): unmeasured against the portable
Triton kernel on an AMD GPU, so the Triton kernel stays the default until it is.

The call follows ROCm/aiter:aiter/fused_moe.py::fused_moe(hidden_states, w1 [E, 2I, H], w2 [E, H, I], topk_weight,
topk_ids, expert_mask=None, activation=ActivationType.Silu, quant_type=QuantType.No, ...) -> [T, H] in the hidden
states' dtype, as vllm-project/vllm:vllm/model_executor/layers/fused_moe/rocm_aiter_fused_moe.py::
rocm_aiter_fused_experts calls it: float32 weights and int32 expert ids [T, top_k], w1 holding each expert's gate
rows then its up rows (omnirun's `w13`), silu(gate) x up, the routed outputs summed with their weights. The routing
is omnirun's own (`route`, HF's order and ties), so only the experts' GEMMs move to aiter.

What stays on the fallback (the platform's portable `fused_moe`): activations or weights outside bf16/fp16 or of
different dtypes, and expert parallelism (a rank holding some experts: aiter takes an `expert_mask` whose semantics
omnirun has not checked on hardware). vLLM shuffles the weights for aiter's preferred kernels first
(aiter.ops.shuffle.shuffle_weight, layout (16, 16)); omnirun passes them as loaded, which aiter reads from
`w1.is_shuffled` (absent: False) when it picks its kernels.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from omnirun.attention.backend import HALF_DTYPES

AITER_MOE_ENV = "OMNIRUN_ROCM_AITER_MOE"  # "1": offer aiter's fused_moe in place of the portable one


def aiter_fused_moe(
    aiter: Any, plain: Callable[..., torch.Tensor], route: Callable[..., tuple[torch.Tensor, torch.Tensor]]
) -> Callable[..., torch.Tensor]:
    """`fused_moe` on aiter's kernels where they take the call, else `plain`; `route` picks the experts (the
    portable one: Triton's where it runs, else the reference)."""
    from aiter.fused_moe import fused_moe as aiter_moe  # imports aiter's JIT machinery: only when offered

    def fused_moe(
        x: torch.Tensor,
        router_logits: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        top_k: int,
        renormalize: bool,
        expert_start: int = 0,
    ) -> torch.Tensor:
        whole = expert_start == 0 and w13.shape[0] == router_logits.shape[-1]
        if x.dtype not in HALF_DTYPES or w13.dtype != x.dtype or w2.dtype != x.dtype or x.dim() != 2 or not whole:
            return plain(x, router_logits, w13, w2, top_k, renormalize, expert_start)
        if x.shape[0] == 0:
            return torch.zeros_like(x)
        weights, experts = route(router_logits, top_k, renormalize)
        return aiter_moe(
            x.contiguous(),
            w13.contiguous(),
            w2.contiguous(),
            weights.to(torch.float32),
            experts.to(torch.int32),
            None,  # expert_mask: every expert on this rank
            aiter.ActivationType.Silu,
            aiter.QuantType.No,
        )

    return fused_moe
