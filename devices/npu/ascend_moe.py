"""omnirun's `fused_moe` on Ascend through torch_npu's MoE kernels, called as vllm-ascend and SGLang call them.

One layer is six kernels: route, sort, count, two grouped GEMMs around swiglu, then combine. Every shape is fixed by
T, top_k and the weights, nothing is read on the host, so a decode step with it is captured in an NPU graph.

1. `npu_moe_gating_top_k_softmax(x, finished=None, k)` -> (y, expert_idx, row_idx): softmax over the last axis,
   then top-k, nothing renormalised; y in x's dtype, expert_idx and row_idx int32 [T, k], row_idx[i, j] = j*T + i.
   x 2-D/3-D float16/bfloat16/float32; 0 < k <= E and k <= 1024 (Ascend/op-plugin
   docs/zh/custom_APIs/torch_npu/torch_npu-npu_moe_gating_top_k_softmax.md). We give it the logits in float32, as
   the reference's softmax computes, and divide by the weights' sum ourselves where `renormalize`, as vllm-ascend
   does after it (vllm_ascend/ops/moe/experts_selector.py::_select_experts_with_fusion_ops,
   _renormalize_topk_weights).
2. `npu_moe_init_routing(x, row_idx=, expert_idx=, active_num=)` -> (expanded_x, expanded_row_idx,
   expanded_expert_idx): a stable sort of the flattened expert ids; expanded_x [min(T, active_num)*k, H] holds the
   token of each sorted slot, expanded_row_idx[j*T + i] is where slot (i, j) went, expanded_expert_idx the sorted
   ids. x 2-D float16/bfloat16/float32 "whose shape size is below 2^24", ids and row_idx int32 [T, k]
   (torch_npu-npu_moe_init_routing.md; CANN hicann/ops-transformer moe/moe_init_routing/docs/aclnnMoeInitRouting_en.md).
   We read the size as the element count and cut larger batches into calls of fewer tokens.
3. `npu_moe_compute_expert_tokens(sorted_expert_for_source_row, num_expert)` -> int32 [num_expert]: for each
   expert the index just past its last row (a binary search), i.e. the cumulative token counts; ids in
   [0, num_expert - 1], fewer than 2^24 of them, 0 < num_expert <= 2048 (torch_npu-npu_moe_compute_expert_tokens.md;
   aclnnMoeComputeExpertTokens_en.md and its golden tests/ut/op_kernel/moe_expert_data/gen_data.py). This is the
   v1 path of vllm-ascend's non-quantised `fused_experts` (vllm_ascend/ops/fused_moe.py, no expert map) and of
   SGLang's `npu_fused_experts_unquant` (python/sglang/srt/hardware_backend/npu/moe/npu_fused_experts.py), cast to
   int64 for the GEMMs; newer vllm-ascend moved to npu_moe_init_routing_v2, which counts in the same call.
4. `npu_grouped_matmul(x=[rows], weight=[w], split_item=2, group_list_type=0, group_type=0, group_list=counts)[0]`:
   y = x_g @ w_g for the rows of each group g (M-axis grouping, one tensor each for x, weight and y). x [M, K] 2-D
   and not transposed, weight [E, K, N] 3-D, or its transpose ("支持weight转置"), group_list int64 1-D, one entry
   per expert, at most 1024 groups, with group_list_type 0 non-decreasing and its last value equal to M; x and
   weight in one of float16/bfloat16/float32, y in x's dtype; every last dimension below 65536 on Atlas A2/A3
   (torch_npu-npu_grouped_matmul.md, 约束说明). Weights: ours are [n, 2I, H] and [n, H, I], HF's layout, which the
   reference and the Triton kernel read; the GEMM wants [E, K, N] = [n, H, 2I] and [n, I, H]. vllm-ascend once
   passed `w.transpose(1, 2)` at each call (fused_moe.py above; moe_mlp.py::unquant_apply_mlp with need_trans)
   and SGLang still does (npu_fused_experts_unquant); newer vllm-ascend transposes a copy at load. We pass the
   transposed views: the doc supports a transposed weight, they cost no memory and no second copy of the experts,
   and the weights stay in the layout the checkpoint loader and expert parallelism write.
5. `npu_swiglu(x, dim=-1)`: silu of the first half times the second half ([gate | up], w13's row order).
6. `npu_moe_finalize_routing(rows, skip1, skip2, bias, scales, expanded_src_to_dst_row, export_for_source_row)`:
   out[i] = skip1 + skip2 + sum_k scales[i, k] * (rows[expanded_src_to_dst_row[k*T + i]] + bias[expert]); rows
   [T*k, H] float16/bfloat16/float32, scales [T, k] in the rows' dtype (so the weights round to x's dtype, as the
   reference's do), expanded_src_to_dst_row int32 in [0, T*k - 1], ids in [0, E - 1], skip2 only with skip1
   (torch_npu-npu_moe_finalize_routing.md, drop_pad_mode 0; the keyword is export_for_source_row in torch_npu's
   schema, Ascend/torchair ge_converter npu_moe_finalize_routing.py).

Expert parallelism (w13/w2 hold experts expert_start .. expert_start + n - 1 of E): the routing ids are mapped to
local ones and every other rank's expert to local expert 0, whose rows are zeroed after the second GEMM (whatever
expert 0 made of them, inf or nan included), so those slots add nothing. Sending them past the last group instead
would break the GEMM's documented "last value equals M" (vllm-ascend notes such rows come back as garbage). The
cost: the foreign slots run through expert 0's GEMMs; npu_moe_init_routing_v2's active_expert_range would drop
them, a later change.

What takes the torch reference (omnirun.layers.native_ops.fused_moe) instead: activations or weights outside
float16/bfloat16/float32 or in different dtypes, non-floating router logits, other than 2-D x/logits or 3-D weights
of matching shapes, weights that are not contiguous (their transposes would not be the GEMM's transposed layout),
top_k outside (0, min(E, 1024)], more than 1024 local experts, H or I of 65536 or more, and an empty batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from omnirun.layers import native_ops

# The torch_npu functions the op calls (ascend_fused_ops offers it where the installed torch_npu has them all).
MOE_KERNELS = (
    "npu_moe_gating_top_k_softmax",
    "npu_moe_init_routing",
    "npu_moe_compute_expert_tokens",
    "npu_grouped_matmul",
    "npu_swiglu",
    "npu_moe_finalize_routing",
)
TOP_K_MAX = 1024  # npu_moe_gating_top_k_softmax: k <= 1024
GROUPS_MAX = 1024  # npu_grouped_matmul, single tensors grouped on M: at most 1024 groups
INNER_LIMIT = 65536  # npu_grouped_matmul on Atlas A2/A3: last dimensions below this
ROUTING_SIZE_LIMIT = 1 << 24  # npu_moe_init_routing's x and npu_moe_compute_expert_tokens' ids: below 2^24
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def takes_routing(x: torch.Tensor, router_logits: torch.Tensor, local: int, top_k: int) -> bool:
    """Whether the routing kernels take these tokens for `local` experts (shapes and dtypes only: no host read,
    graph-safe)."""
    if x.dim() != 2 or router_logits.dim() != 2:
        return False
    return (
        x.dtype in _DTYPES
        and router_logits.is_floating_point()
        and router_logits.shape[0] == x.shape[0]
        and x.shape[0] > 0
        and 0 < top_k <= min(router_logits.shape[1], TOP_K_MAX)
        and 0 < local <= GROUPS_MAX
        and x.shape[1] < INNER_LIMIT
    )


def _on_the_kernels(
    x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int
) -> bool:
    """Whether the kernels' documented constraints hold (shapes and dtypes only: no host read, graph-safe)."""
    if w13.dim() != 3 or w2.dim() != 3 or not takes_routing(x, router_logits, w13.shape[0], top_k):
        return False
    experts, inter, hidden = w13.shape[0], w2.shape[2], x.shape[1]
    return (
        w13.dtype == x.dtype
        and w2.dtype == x.dtype
        and w13.shape == (experts, 2 * inter, hidden)
        and w2.shape == (experts, hidden, inter)
        and w13.is_contiguous()
        and w2.is_contiguous()
        and inter < INNER_LIMIT
    )


# A projection of every local expert: (the routed rows sorted by expert [T*k, K], the cumulative rows per expert) ->
# [T*k, N].
Projection = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def routed_experts(
    torch_npu: Any,
    x: torch.Tensor,
    router_logits: torch.Tensor,
    local: int,
    top_k: int,
    renormalize: bool,
    expert_start: int,
    gate_up: Projection,
    down: Projection,
) -> torch.Tensor:
    """The mixture on the routing kernels, each projection a grouped matmul given by the caller (takes_routing said
    they take it). init_routing's x and the T*k sorted ids stay below 2^24 elements: long prefills go in several
    calls."""
    whole = expert_start == 0 and local == router_logits.shape[1]

    def routed(x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights, ids, row_idx = torch_npu.npu_moe_gating_top_k_softmax(router_logits.float(), None, k=top_k)
        if renormalize:  # the kernel does softmax then top-k, nothing more
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not whole:  # expert parallelism: other ranks' experts go to local expert 0, their rows zeroed below
            ids = ids - expert_start
            mine = (ids >= 0) & (ids < local)
            ids = torch.where(mine, ids, 0)
        expanded_x, expanded_row_idx, sorted_ids = torch_npu.npu_moe_init_routing(
            x, row_idx=row_idx, expert_idx=ids, active_num=x.shape[0]
        )
        counts = torch_npu.npu_moe_compute_expert_tokens(sorted_ids, local).to(torch.int64)  # cumulative
        rows = down(torch_npu.npu_swiglu(gate_up(expanded_x, counts), dim=-1), counts)  # [T*k, H]; [gate | up]
        if not whole:
            # Slot (i, j) sits at row expanded_row_idx[j*T + i]: the slot order of mine.t().
            mine_by_slot = mine.t().reshape(-1)
            mine_by_row = torch.zeros_like(mine_by_slot).scatter_(0, expanded_row_idx.long(), mine_by_slot)
            rows = rows.masked_fill(~mine_by_row[:, None], 0)
        return torch_npu.npu_moe_finalize_routing(
            rows,
            skip1=None,
            skip2=None,
            bias=None,
            scales=weights.to(x.dtype),
            expanded_src_to_dst_row=expanded_row_idx,
            export_for_source_row=ids,
        )

    per_call = (ROUTING_SIZE_LIMIT - 1) // max(x.shape[1], top_k)
    parts = [routed(x[s : s + per_call], router_logits[s : s + per_call]) for s in range(0, x.shape[0], per_call)]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def ascend_fused_moe(torch_npu: Any) -> Callable[..., torch.Tensor]:
    """`fused_moe` on torch_npu's MoE kernels where their constraints hold, else the reference."""

    def grouped_matmul(weight: torch.Tensor) -> Projection:
        # [n, N, K] transposed: the GEMM's [n, K, N] as a view (see 4. above)
        def project(rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
            return torch_npu.npu_grouped_matmul(
                x=[rows], weight=[weight.transpose(1, 2)], split_item=2, group_list_type=0, group_type=0,
                group_list=counts,
            )[0]  # fmt: skip

        return project

    def fused_moe(
        x: torch.Tensor,
        router_logits: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        top_k: int,
        renormalize: bool,
        expert_start: int = 0,
    ) -> torch.Tensor:
        if not _on_the_kernels(x, router_logits, w13, w2, top_k):
            return native_ops.fused_moe(x, router_logits, w13, w2, top_k, renormalize, expert_start)
        return routed_experts(
            torch_npu, x, router_logits, w13.shape[0], top_k, renormalize, expert_start, grouped_matmul(w13),
            grouped_matmul(w2),
        )  # fmt: skip

    return fused_moe
