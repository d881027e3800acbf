"""The fake `aiter`'s fused MoE (fake_aiter.py builds the module): aiter.fused_moe.fused_moe as ROCm/aiter's
aiter/fused_moe.py::fused_moe takes it, computed with plain torch, refusing what the fake cannot vouch for.

Checked as the real entry point reads its arguments: hidden states fp16/bf16 (the out dtype it asserts), w1
[E, 2I, H] (gate rows, then up rows: "G1U1") or [E, I, H], w2 [E, H, I] of the hidden states' dtype, topk_ids int32
and topk_weight float32, both [T, top_k] (the dtypes vLLM's rocm_aiter_fused_experts converts to before the call).
Only the unquantized silu path is faked (quant_type No, activation Silu, no expert_mask, no bias): anything else
raises. Each expert's GEMMs run over every token with a dense routing weight (zero for tokens that did not pick
it), so nothing reads a value on the host and the call records into a graph.
"""

from __future__ import annotations

import enum
import importlib.machinery
import types

import torch
import torch.nn.functional as F
from fake_aiter_fp8 import QuantType  # aiter's one QuantType: the fp8 GEMMs' quantizers key by it too

HALF = (torch.bfloat16, torch.float16)


class ActivationType(enum.Enum):  # aiter's enums (aiter/__init__.py re-exports them); vLLM mirrors Silu = 0
    Silu = 0
    Gelu = 1


def moe_module(require, counted) -> types.ModuleType:
    """The fake `aiter.fused_moe` submodule."""
    module = types.ModuleType("aiter.fused_moe", "fake aiter.fused_moe (omnirun tests)")
    module.__spec__ = importlib.machinery.ModuleSpec("aiter.fused_moe", loader=None)

    def fused_moe(
        hidden_states,
        w1,
        w2,
        topk_weight,
        topk_ids,
        expert_mask=None,
        activation=ActivationType.Silu,
        quant_type=QuantType.No,
        doweight_stage1=False,
        w1_scale=None,
        w2_scale=None,
        a1_scale=None,
        a2_scale=None,
        block_size_M=None,
        num_local_tokens=None,
        moe_sorting_dispatch_policy=0,
        dtype=None,
        hidden_pad=0,
        intermediate_pad=0,
        bias1=None,
        bias2=None,
        splitk=0,
    ):
        x = hidden_states
        require(x.dtype in HALF and (dtype is None or dtype in HALF), f"fused_moe: unsupported out dtype {x.dtype}")
        experts, hidden, inter = w2.shape
        require(w1.dim() == 3 and w1.shape[0] == experts and w1.shape[2] == hidden, f"fused_moe: w1 {list(w1.shape)}")
        require(w1.shape[1] == 2 * inter, "fused_moe: only gate|up weights (G1U1) are faked")
        require(w1.dtype == w2.dtype == x.dtype, "fused_moe: weights must be in the hidden states' dtype (a16w16)")
        require(topk_ids.dtype == torch.int32 and topk_weight.dtype == torch.float32, "topk ids int32, weights fp32")
        require(topk_ids.shape == topk_weight.shape == (x.shape[0], topk_ids.shape[1]), "topk shapes [T, top_k]")
        require(expert_mask is None and bias1 is None and bias2 is None and not doweight_stage1, "not faked")
        require(activation == ActivationType.Silu and quant_type == QuantType.No, "only silu, unquantized, faked")
        out = torch.zeros(x.shape[0], hidden, dtype=torch.float32, device=x.device)
        for e in range(experts):
            routed = (topk_weight * (topk_ids == e)).sum(dim=-1, keepdim=True)  # [T, 1]: 0 where not picked
            gate, up = F.linear(x, w1[e]).chunk(2, dim=-1)
            out += routed * F.linear((F.silu(gate.float()) * up.float()).to(x.dtype), w2[e]).float()
        return out.to(dtype or x.dtype)

    module.fused_moe = counted(fused_moe)
    return module
