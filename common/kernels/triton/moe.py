"""The `fused_moe` op in Triton: a mixture of experts as two grouped GEMMs, with no host sync (graph-capturable).

As vLLM's and SGLang's fused_moe do: each (token, k-th choice) pair is a *slot*; slots are sorted by expert and
each expert's run padded to a whole number of BLOCK_M rows, so that every block of rows belongs to one expert.
One launch multiplies every block by its expert's gate|up weights, the activation runs on all slots at once, a
second launch multiplies by the experts' down weights and the routing weight, and each token sums its top_k slots.
The grid is sized for the most blocks the slots can fill (every expert's run padded), and blocks past the real
total return at once: the sizes depend on the token count alone, never on the routing, so nothing waits for the
host. The routing itself (float32 softmax, top-k, renormalisation) is the reference's.

Importing this module imports triton; the capability gate (omnirun.kernels) offers it only where triton runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from omnirun.kernels.triton.modes import INTERPRETED

_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit(do_not_specialize=["num_slots"])
def _grouped_gemm_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    weights_ptr,
    sorted_slots_ptr,
    block_experts_ptr,
    total_ptr,
    num_slots,
    N,
    K,
    stride_am,
    stride_be,
    stride_bn,
    stride_cm,
    SLOTS_PER_ROW: tl.constexpr,  # a row of `a` feeds this many slots (top_k for the tokens, 1 for the slots)
    MUL_WEIGHTS: tl.constexpr,
    IEEE: tl.constexpr,  # float32 inputs: exact products (no tf32)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    if pid_m * BLOCK_M >= tl.load(total_ptr):
        return
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    slots = tl.load(sorted_slots_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = slots < num_slots  # the padding of an expert's run
    rows = (slots // SLOTS_PER_ROW).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(
            a_ptr + rows[:, None] * stride_am + offs_k[None, :],
            mask=valid[:, None] & (offs_k[None, :] < K),
            other=0.0,
        )
        b = tl.load(
            b_ptr + expert * stride_be + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None],
            mask=(offs_n[None, :] < N) & (offs_k[:, None] < K),
            other=0.0,
        )
        if INTERPRETED:  # the interpreter's dot multiplies 16-bit floats' raw bits: give it float32
            acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        elif IEEE:
            acc += tl.dot(a, b, input_precision="ieee")
        else:
            acc += tl.dot(a, b)
    if MUL_WEIGHTS:
        acc *= tl.load(weights_ptr + slots, mask=valid, other=0.0)[:, None]
    out = c_ptr + slots[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    tl.store(out, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & (offs_n[None, :] < N))


def sort_slots(
    experts: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Slots (flattened [T, top_k] expert choices) sorted by expert, each expert's run padded to whole blocks of
    block_m (padding: the slot count, past every slot). Returns (sorted slots [capacity], each block's expert
    [capacity / block_m], the padded total [1]), all on the device, capacity fixed by T alone."""
    flat = experts.flatten()
    slots = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # (bincount would read the maximum on the host)
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    order = torch.sort(flat, stable=True).indices
    by_expert = flat[order]
    rank = torch.arange(slots, device=flat.device) - (counts.cumsum(0) - counts)[by_expert]
    capacity = triton.cdiv(slots + num_experts * (block_m - 1), block_m) * block_m
    sorted_slots = torch.full((capacity,), slots, dtype=torch.int64, device=flat.device)
    sorted_slots[(padded_end - padded)[by_expert] + rank] = order
    starts = torch.arange(0, capacity, block_m, device=flat.device)
    block_experts = torch.searchsorted(padded_end, starts, right=True).clamp(max=num_experts - 1)
    return sorted_slots, block_experts, padded_end[-1:]


def _grouped_gemm(a, b, sorted_slots, block_experts, total, num_slots, slots_per_row, weights, out_dtype, block_m):
    """out[slot] = a[slot // slots_per_row] @ b[expert of slot].T (x the slot's weight), for every real slot."""
    n, k = b.shape[1], b.shape[2]
    out = torch.empty(num_slots, n, dtype=out_dtype, device=a.device)
    block_n, block_k = 64, 32
    grid = (block_experts.numel(), triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a,
        b,
        out,
        weights if weights is not None else out,
        sorted_slots,
        block_experts,
        total,
        num_slots,
        n,
        k,
        a.stride(0),
        b.stride(0),
        b.stride(1),
        out.stride(0),
        SLOTS_PER_ROW=slots_per_row,
        MUL_WEIGHTS=weights is not None,
        IEEE=a.dtype == torch.float32,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=4,
    )
    return out


def fused_moe(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    renormalize: bool,
    expert_start: int = 0,
) -> torch.Tensor:
    """See omnirun.layers.native_ops.fused_moe (the reference): the same mixture, summed per token over its top_k
    choices (in float32, rounded once) rather than expert by expert. Slots routed to another rank's experts (expert
    parallelism) weigh nothing here (they are computed by this rank's first expert and multiplied by 0: simple,
    not yet cheap)."""
    from omnirun.layers import native_ops

    if x.dtype not in _KERNEL_DTYPES or w13.dtype != x.dtype or w2.dtype != x.dtype or x.dim() != 2:
        return native_ops.fused_moe(x, router_logits, w13, w2, top_k, renormalize, expert_start)
    tokens = x.shape[0]
    if tokens == 0:
        return torch.zeros_like(x)
    weights, experts = native_ops.route(router_logits, top_k, renormalize)
    local = w13.shape[0]
    if local != router_logits.shape[-1]:  # expert parallelism: this rank holds experts expert_start.. only
        experts = experts - expert_start
        mine = (experts >= 0) & (experts < local)
        weights, experts = torch.where(mine, weights, 0.0), torch.where(mine, experts, 0)
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    slots = tokens * top_k
    block_m = 16 if slots <= 32 * w13.shape[0] else 64  # few rows per expert while decoding
    sorted_slots, block_experts, total = sort_slots(experts, w13.shape[0], block_m)
    gate_up = _grouped_gemm(x, w13, sorted_slots, block_experts, total, slots, top_k, None, x.dtype, block_m)
    gate, up = gate_up.chunk(2, dim=-1)
    hidden = (F.silu(gate) * up).contiguous()
    weighted = _grouped_gemm(
        hidden, w2, sorted_slots, block_experts, total, slots, 1, weights.flatten(), torch.float32, block_m
    )
    return weighted.view(tokens, top_k, -1).sum(dim=1).to(x.dtype)
