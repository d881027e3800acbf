"""omnirun's `fused_moe` on Intel GPUs through IPEX's MoE module, `ipex.llm.modules.GatedMLPMOE`, called as vLLM
calls it on XPU.

What IPEX has (intel/intel-extension-for-pytorch at tag v2.8.10+xpu; v2.10.10+xpu, its last XPU tag, where it differs):

1. The frontend, `GatedMLPMOE(W13, W2, W3=None, use_prepack=True, w1_scale_inv=None, w2_scale_inv=None,
   a1_scale_inv=None, a2_scale_inv=None)` (intel_extension_for_pytorch/llm/modules/linear_fusion.py, exported by
   llm/modules/__init__.py): W13 [E, 2I, H] holds each expert's gate_proj then up_proj rows (or gate_proj alone, with
   W3 its up_proj), W2 [E, H, I] its down_proj: HF's layout, which is ours. Its forward is `(hidden_states,
   use_grouped_topk, top_k, router_logits, renormalize, topk_group=None, num_expert_group=None,
   custom_routing_function=None, scoring_func="softmax", e_score_correction_bias=None)` -> [T, H]. The first forward
   builds the implementation of the input's device type (llm/modules/utils.py: LINEAR_MOE -> _IPEXGatedMLPMOEXPU).
2. The XPU implementation (transformers/models/xpu/fusions/linear_fusion.py::_IPEXGatedMLPMOEXPU) keeps
   `torch.transpose(W13, 1, 2).contiguous()` [E, H, 2I] and the same of W2 [E, I, H], then points the tensors it was
   given at them (`W13.data = self.W13`, "delete original weight to avoid memory pressure"): the caller's tensors
   change shape. use_prepack is not read on XPU; the scales are for fp8 weights. IPEX's own test hands it deep copies
   (tests/gpu/examples/moe/test_gated_mlp_moe.py). Its forward: `torch_ipex.topk_softmax(router_logits, top_k,
   False)` -> float32 weights, int32 ids, rows per expert, offsets; `moe_scatter` sorts the token rows by expert;
   `rows_for_experts.to("cpu")`; `torch.xpu.moe_gemm` on W13; `torch_ipex.silu_and_mul` (silu of the first half times
   the second: [gate | up]); `moe_gemm` on W2; `moe_gather(..., renormalize)`, which sums each token's top_k rows
   times their weights in float32 (divided by the weights' sum first where renormalize) and rounds once.
3. Kernel limits (csrc/gpu/aten/operators/MoeOps.cpp): topk_softmax takes 2-D logits of at most 128 experts
   (TORCH_CHECK "n_experts only support up to 128"), float32/float64/bfloat16/float16; it picks the top_k largest
   logits (ties to the lower index) and gives their softmax over all experts, computed in float32. moe_scatter and
   moe_gather are instantiated for top_k 1, 2, 4, 6 and 8 only ("not support topk"), at most 256 experts, and need
   H to be a multiple of 16 bytes of elements, 4 in float32 and 8 in bfloat16/float16 ("n_channels is expected to be
   aligned to Kernel::ElemsPerItem"). moe_gemm (xpu/intrinsic/__init__.py) runs XeTLA's grouped GEMM
   (torch_ipex.fused_moe_gemm) on GPUs with 2D block loads and XMX (Data Center GPU Max, Arc) for 8 or 16 experts,
   whatever the dtype, launched over a range it computes from the host copy of the counts; that kernel takes half and
   bfloat16 only (csrc/gpu/aten/operators/transformers/moe_gemm.cpp: "only support half and bfloat16 now"). Other
   cases loop over the experts with torch.mm, reading each count with .item(). v2.10.10 takes the fused (persistent)
   kernel on every XMX GPU, with the same dtypes. So float32 fails on XMX GPUs (v2.8.10: with 8 or 16 experts,
   Mixtral's 8 among them; v2.10.10: always): we never send it.
4. Expert parallelism: v2.8.10+xpu takes no expert offset. The module's experts are W2.shape[0], numbered from 0,
   and topk_softmax counts rows for every column of the logits. v2.10.10+xpu adds the constructor keyword
   `experts_start_id`: moe_rows_counts gives other experts' slots the offset -1, moe_scatter skips them and
   moe_gather leaves them out, renormalising over all top_k weights still. vLLM passes it:
   `GatedMLPMOE(layer.w13_weight, layer.w2_weight, use_prepack=True, experts_start_id=ep_rank_start)`, then
   `layer.ipex_fusion(x, use_grouped_topk, top_k, router_logits, renormalize, topk_group, num_expert_group,
   custom_routing_function=...)` (vllm-project/vllm@017b8f23: vllm/model_executor/layers/fused_moe/
   unquantized_fused_moe_method.py, process_weights_after_loading and forward_xpu). v2.10.10 also takes topk_softmax's
   outputs as arguments and, on XMX GPUs, runs moe_gemm as a persistent kernel without the host copy; other GPUs
   keep it. We pass the offset where the installed frontend's constructor takes `experts_start_id`.
5. The host read: a v2.8.10 forward copies the row counts to the host, which no XPU graph can capture (a replay
   would launch with the counts of the capture). assemble() turns decode graphs on for a mixture-of-experts model
   whenever the platform offers fused_moe, so XpuPlatform offers this op only where torch has no XPU graph API: on
   every real IPEX install (the last one pins torch 2.10; XPUGraph came with torch 2.11).

How we call it: x contiguous; the router logits in float32, contiguous (the reference's softmax runs in float32;
topk_softmax reads them in their own dtype); use_grouped_topk False; renormalize as given.

The weights: one module per (w13, w2) pair, built on its first call and cached. The module holds the weights in its
layout, and we give it ours rather than a copy: w13 and w2 are re-pointed (`.data`) at transposed views of
contiguous [n, H, 2I] and [n, I, H] buffers (same shape, dtype and values; strides transposed), and the module is
built on aliases of them, so IPEX's transpose-and-contiguous is that buffer (no second copy of the experts in memory)
and its `.data` swap lands on the alias, not on our parameter. Every later write to w13/w2 lands in the buffers the
kernel reads, including omnirun's weight updates, which copy into views of `param.data` (common/weights.py,
layers/moe.py::SparseMoE.expert_target). That is why the cache is not keyed on the tensors' version counters: writes
through `.data` get a fresh counter, so the parameter's `_version` does not move and a version key would miss
exactly omnirun's updates. The key is (id(w13), id(w2), expert_start), checked against weak references to the two
tensors, their storage pointers and strides (host attributes: no device read): a parameter given new storage
(`param.data = other`) gets a new module, and a tensor that dies takes its entry with it. The buffers are made
outside inference mode (the runner's forward runs in it), since an inference tensor refuses later in-place updates.

What takes the fallback (the platform's portable `fused_moe`, Triton's where it runs, else the torch reference
omnirun.layers.native_ops.fused_moe): activations other than bfloat16/float16 (float32 included: see 3), weights of
another dtype, non-floating logits, other than 2-D x/logits and 3-D weights of matching shapes, an empty batch, more
than 128 experts in the logits, top_k other than 1, 2, 4, 6 or 8 (or above the experts), H not a multiple of 8
elements (16 bytes), and expert parallelism (w13/w2 holding fewer experts than the logits, or expert_start > 0) where
the installed IPEX takes no `experts_start_id`. The checks read shapes and dtypes only.
"""

from __future__ import annotations

import dataclasses
import inspect
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch

from omnirun.layers import native_ops

MODULE = "GatedMLPMOE"  # ipex.llm.modules.GatedMLPMOE
EXPERT_OFFSET = "experts_start_id"  # the constructor keyword v2.10.10+xpu added (expert parallelism)
TOP_KS = (1, 2, 4, 6, 8)  # moe_scatter / moe_gather instantiations
EXPERTS_MAX = 128  # topk_softmax: n_experts only support up to 128
VECTOR_BYTES = 16  # moe_scatter / moe_gather: H a multiple of 16 bytes of elements
KERNEL_DTYPES = (torch.bfloat16, torch.float16)  # fused_moe_gemm: half and bfloat16 only (float32 fails on XMX GPUs)


def takes_expert_offset(gated_mlp_moe: Any) -> bool:
    """Whether this GatedMLPMOE's constructor takes the first expert's global id (v2.10.10+xpu on)."""
    try:
        return EXPERT_OFFSET in inspect.signature(gated_mlp_moe).parameters
    except (TypeError, ValueError):
        return False


def _on_the_kernel(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    expert_start: int,
    offsets: bool,
) -> bool:
    """Whether IPEX's documented limits hold (shapes and dtypes only: no host read of a device value)."""
    if x.dim() != 2 or router_logits.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        return False
    tokens, hidden = x.shape
    experts, local, inter = router_logits.shape[1], w13.shape[0], w2.shape[2]
    whole = expert_start == 0 and local == experts
    return (
        x.dtype in KERNEL_DTYPES
        and w13.dtype == x.dtype
        and w2.dtype == x.dtype
        and router_logits.is_floating_point()
        and router_logits.shape[0] == tokens > 0
        and inter > 0
        and w13.shape == (local, 2 * inter, hidden)
        and w2.shape == (local, hidden, inter)
        and 0 < experts <= EXPERTS_MAX
        and top_k in TOP_KS
        and top_k <= experts
        and hidden % (VECTOR_BYTES // x.element_size()) == 0
        and (whole or (offsets and 0 <= expert_start and expert_start + local <= experts))
    )


def _to_kernel_layout(weight: torch.Tensor) -> None:
    """Point `weight` [n, a, b] at a transposed view of a contiguous [n, b, a] copy of itself (a no-op once it is),
    the layout IPEX's grouped GEMM reads. Made outside inference mode unless the weight is an inference tensor."""
    if weight.transpose(1, 2).is_contiguous():
        return
    with torch.inference_mode(weight.is_inference()):
        weight.data = weight.transpose(1, 2).contiguous().transpose(1, 2)


def _storage(w13: torch.Tensor, w2: torch.Tensor) -> tuple[Any, ...]:
    return (w13.data_ptr(), w13.stride(), w2.data_ptr(), w2.stride())


@dataclasses.dataclass
class _Built:
    w13: weakref.ref
    w2: weakref.ref
    storage: tuple[Any, ...]
    module: Any


def ipex_moe_ops(fallback: Mapping[str, Callable[..., Any]]) -> dict[str, Callable[..., Any]]:
    """{"fused_moe": IPEX's MoE module as our op} where the installed IPEX has GatedMLPMOE, else {} (imports IPEX)."""
    import intel_extension_for_pytorch as ipex

    gated_mlp_moe = getattr(getattr(getattr(ipex, "llm", None), "modules", None), MODULE, None)
    if gated_mlp_moe is None:
        return {}
    return {"fused_moe": ipex_fused_moe(gated_mlp_moe, fallback.get("fused_moe", native_ops.fused_moe))}


def ipex_fused_moe(gated_mlp_moe: Any, plain: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`fused_moe` on `gated_mlp_moe` (ipex.llm.modules.GatedMLPMOE) where its limits hold, else `plain`."""
    offsets = takes_expert_offset(gated_mlp_moe)
    built: dict[tuple[int, int, int], _Built] = {}

    def module_for(w13: torch.Tensor, w2: torch.Tensor, expert_start: int) -> Any:
        key = (id(w13), id(w2), expert_start)
        entry = built.get(key)
        if entry is not None and entry.w13() is w13 and entry.w2() is w2 and entry.storage == _storage(w13, w2):
            return entry.module
        _to_kernel_layout(w13)
        _to_kernel_layout(w2)
        extra = {EXPERT_OFFSET: expert_start} if offsets else {}
        # Aliases (new tensor objects on the same storage): IPEX re-points what it is given, never our parameters.
        module = gated_mlp_moe(w13.detach(), w2.detach(), use_prepack=True, **extra)
        built[key] = _Built(weakref.ref(w13), weakref.ref(w2), _storage(w13, w2), module)
        for weight in (w13, w2):  # a weight that dies takes the module (and its aliases of the buffers) with it
            weakref.finalize(weight, built.pop, key, None)
        return module

    def fused_moe(
        x: torch.Tensor,
        router_logits: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        top_k: int,
        renormalize: bool,
        expert_start: int = 0,
    ) -> torch.Tensor:
        if not _on_the_kernel(x, router_logits, w13, w2, top_k, expert_start, offsets):
            return plain(x, router_logits, w13, w2, top_k, renormalize, expert_start)
        module = module_for(w13, w2, expert_start)
        # forward(hidden_states, use_grouped_topk, top_k, router_logits, renormalize), positional as vLLM calls it.
        return module(x.contiguous(), False, top_k, router_logits.float().contiguous(), renormalize)

    return fused_moe
