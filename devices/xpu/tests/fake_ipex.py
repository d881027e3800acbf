"""A fake `intel_extension_for_pytorch` for tests without Intel hardware: the calls omnirun makes, with IPEX's
documented semantics in plain torch on CPU tensors, and as strict about shapes, dtypes and layouts as the real ops.

`make_ipex("xpu")` follows the XPU build (v2.8.10+xpu), whose kernels the host stands in for: NHD caches
[pages, page_size, kv_heads, head_dim], contiguous; int32 cu_seqlens and block tables; bf16/fp16 attention only;
head dims not a multiple of 64 padded through block_table.unique() (a device sync on a real GPU, so a host read
here, which a graph capture refuses). `make_ipex("cpu")` follows the CPU build (v2.8.0+cpu): caches read through
strides as [pages, kv_heads, page_size, head_dim], fp8 only as e5m2, no silu_and_mul / rotary_embedding_batched.

The attention math runs without any host read (batches are padded to the max lengths IPEX is given), so it can be
recorded by omnirun_fakes.device's RecordingGraph like a kernel in a device graph. `calls` counts each entry point.

The XPU build's quantized linear layers: `llm.quantization.IPEXWeightOnlyQuantizedLinear.from_weight` with the AWQ
method (v2.5.10+xpu on) repacks AutoAWQ's words into GPTQ's in the very tensors it is given, as v2.8.10 does, and
ignores a bias handed to its forward for int4; `torch.ops.torch_ipex.fp8_gemm_w8a16` (v2.8.10+xpu on) takes one scale
per weight. Both refuse float32 rows (omnirun never sends them): XeTLA's int4 kernels would compute them in half, the
fp8 GEMM asserts. The torch op is not registered with torch: `torch_ops` lists it, and the installers put it on
`torch.ops.torch_ipex`.

The XPU build's `llm.modules.GatedMLPMOE` (the mixture-of-experts module) follows v2.8.10+xpu on a GPU with XMX: the
first forward keeps contiguous transposes of W13/W2 and re-points the tensors it was given at them (`W13.data = ...`),
routes by softmax top-k in float32, renormalises where asked, runs silu(gate) * up per expert, refuses float32 where
XeTLA's grouped GEMM runs (8 or 16 experts), and reads the row counts on the host as `rows_for_experts.to("cpu")` does
(so a graph capture refuses it). Builds numbered 2.10 or later follow v2.10.10+xpu where it differs: they take
`experts_start_id` (other experts' slots add nothing) and run XeTLA's GEMM, half and bfloat16 only, for any count.
"""

from __future__ import annotations

import collections
import enum
import importlib.machinery
import types
from typing import Any

import torch

HALF = (torch.bfloat16, torch.float16)
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
MOE_TOP_KS = (1, 2, 4, 6, 8)  # moe_scatter / moe_gather instantiations (MoeOps.cpp)
MOE_DTYPES = (*KERNEL_DTYPES, torch.float64)  # topk_softmax / moe_scatter / moe_gather dispatch


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise RuntimeError(message)


def _cache_dtype_matches(cache: torch.Tensor, source_dtype: torch.dtype, kv_cache_dtype: str, build: str) -> None:
    if kv_cache_dtype == "auto":
        _check(cache.dtype == source_dtype, f"kv_cache_dtype 'auto' needs a {source_dtype} cache, got {cache.dtype}")
        return
    _check(kv_cache_dtype in FP8, f"Unsupported data type of kv cache: {kv_cache_dtype}")
    if build == "cpu":
        _check(kv_cache_dtype in ("fp8", "fp8_e5m2") and cache.dtype == torch.float8_e5m2, "only float8_e5m2 supported")
        _check(source_dtype in (torch.float32, torch.bfloat16), "Unsupported data type for ipex::reshape_and_cache")
        return
    _check(cache.dtype == FP8[kv_cache_dtype], f"kv_cache_dtype {kv_cache_dtype} with a {cache.dtype} cache")


def _layout(cache: torch.Tensor, build: str) -> tuple[int, int, int]:
    """(pages, page_size, kv_heads) of a paged cache in this build's layout."""
    _check(cache.dim() == 4, f"a paged cache is 4-D, got {tuple(cache.shape)}")
    _check(cache.stride(-1) == 1, "the head dim of a paged cache must be contiguous")
    if build == "xpu":
        _check(cache.is_contiguous(), "key must be contiguous")  # chunked_prefill's TORCH_CHECK
        return cache.shape[0], cache.shape[1], cache.shape[2]
    return cache.shape[0], cache.shape[2], cache.shape[1]


def _tokens(cache: torch.Tensor, build: str) -> torch.Tensor:
    """[pages, page_size, kv_heads, head_dim] view of a cache (CPU caches are [pages, kv_heads, page_size, D])."""
    return cache if build == "xpu" else cache.transpose(1, 2)


def _store(cache: torch.Tensor, slots: torch.Tensor, values: torch.Tensor, build: str) -> None:
    pages, page_size, _ = _layout(cache, build)
    tokens = _tokens(cache, build)
    stored = values.to(cache.dtype)
    if cache.dtype.itemsize == 1:  # indexed stores of fp8 are not implemented on every device: same bits as bytes
        tokens, stored = tokens.view(torch.uint8), stored.view(torch.uint8)
    tokens[torch.div(slots, page_size, rounding_mode="floor"), slots % page_size] = stored


def _attention(
    build: str,
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_kv: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_kv: int,
    scale: float,
    block_table: torch.Tensor,
    window_left: int,
) -> None:
    """Causal attention aligned to the bottom right: query i of a request with q_len new and kv_len total tokens
    sits at position kv_len - q_len + i and sees keys up to it (and, with a window, window_left keys before it)."""
    tokens, heads, head_dim = query.shape
    _, page_size, kv_heads = _layout(key_cache, build)
    _check(heads % kv_heads == 0, f"{heads} query heads over {kv_heads} KV heads")
    batch = cu_seqlens_q.numel() - 1
    _check(block_table.shape[0] == batch, "The first dimension of block_table should be equal to batch_size")
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    kv_lens = (cu_seqlens_kv[1:] - cu_seqlens_kv[:-1]).long()
    i = torch.arange(max_seqlen_q, device=query.device)
    j = torch.arange(max_seqlen_kv, device=query.device)
    q_valid = i[None, :] < q_lens[:, None]  # [batch, max_q]
    rows = torch.where(q_valid, cu_seqlens_q[:-1, None].long() + i[None, :], tokens)  # padding -> a dummy row
    q = torch.cat([query, query.new_zeros(1, heads, head_dim)])[rows].float()  # [batch, max_q, heads, D]
    page = block_table.long()[:, (j // page_size).clamp(max=block_table.shape[1] - 1)]  # [batch, max_kv]
    k_tokens, v_tokens = _tokens(key_cache, build), _tokens(value_cache, build)
    k = k_tokens[page, j % page_size].float()  # [batch, max_kv, kv_heads, D]
    v = v_tokens[page, j % page_size].float()
    group = heads // kv_heads
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    position = (kv_lens - q_lens)[:, None] + i[None, :]  # [batch, max_q]
    mask = (j[None, None, :] <= position[:, :, None]) & (j[None, None, :] < kv_lens[:, None, None])
    if window_left >= 0:
        mask &= j[None, None, :] >= position[:, :, None] - window_left
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    probs = torch.nan_to_num(scores.softmax(dim=-1))  # rows without a key (padding) give zeros, not NaN
    o = torch.einsum("bhqk,bkhd->bqhd", probs, v).to(out.dtype)
    padded = torch.cat([out, out.new_zeros(1, heads, head_dim)])
    padded[rows] = o
    out.copy_(padded[:tokens])


def _convert_from_fp8(dtype: torch.dtype, cache: torch.Tensor) -> torch.Tensor:
    """The XPU build converts fp8 caches to the query dtype before its kernels (mha_fusion.py::convert_from_fp8)."""
    return cache.to(dtype) if cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else cache


def make_paged_attention(build: str, calls: collections.Counter) -> type:
    class PagedAttention:
        @staticmethod
        def reshape_and_cache(
            key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype="auto", k_scale=1.0, v_scale=1.0
        ):
            calls["reshape_and_cache"] += 1
            if build == "xpu":
                _check(key_cache.dim() == 5, "the XPU reshape_and_cache needs K [pages, heads, D/x, page_size, x]")
            _paged_store(build, key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype)

        @staticmethod
        def reshape_and_cache_flash(
            key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype="auto", k_scale=1.0, v_scale=1.0
        ):
            calls["reshape_and_cache_flash"] += 1
            _check(key_cache.stride(0) == value_cache.stride(0), "key and value caches differ in their block stride")
            _paged_store(build, key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype)

        @staticmethod
        def single_query_cached_kv_attention(
            output,
            query,
            key_cache,
            value_cache,
            head_mapping,
            scale,
            block_tables,
            context_lens,
            block_size,
            max_context_len,
            alibi_slopes,
            *args,
            window_size=-1,
            k_scale=1.0,
            v_scale=1.0,
            softcap=-1.0,
        ):
            calls["single_query_cached_kv_attention"] += 1
            _check(build == "cpu", "the XPU decode kernel needs caches [pages, kv_heads, head_dim, page_size]")
            _check(not args, "the CPU frontend has no kv_cache_dtype argument: pass window_size and on by keyword")
            _check(alibi_slopes is None and window_size == -1 and softcap == -1.0, "only plain attention is faked")
            _check(query.dim() == 3 and output.shape == query.shape, "query and output are [seqs, heads, head_size]")
            _check(head_mapping.dtype == torch.int32 and head_mapping.numel() == query.shape[1], "head_mapping [heads]")
            _check(block_tables.dtype == torch.int32 and context_lens.dtype == torch.int32, "int32 tables and lengths")
            _, page_size, kv_heads = _layout(key_cache, build)
            _check(block_size == page_size, f"block_size {block_size} but the cache holds pages of {page_size}")
            _check(key_cache.shape == value_cache.shape, "key and value caches differ")
            seqs = query.shape[0]
            cu_q = torch.arange(seqs + 1, dtype=torch.int32, device=query.device)
            cu_kv = torch.cat([context_lens.new_zeros(1), context_lens.cumsum(0, dtype=torch.int32)])
            _attention(
                build, output, query, key_cache, value_cache, cu_q, cu_kv, 1, max_context_len, scale, block_tables, -1
            )

        @staticmethod
        def flash_attn_varlen_func(
            output,
            query,
            key_cache,
            value_cache,
            cu_seqlens_q,
            cu_seqlens_kv,
            max_seqlen_q,
            max_seqlen_kv,
            scale,
            is_cusal,
            block_tables,
            alibi_slopes,
            window_size_left=-1,
            window_size_right=-1,
            kv_cache_dtype="auto",
            k_scale=1.0,
            v_scale=1.0,
            softcap=-1.0,
        ):
            calls["flash_attn_varlen_func"] += 1
            _check(is_cusal, "is_cusal=False is not supported")
            _check(alibi_slopes is None and window_size_right == -1 and softcap == -1.0, "only causal is faked")
            tables = {"cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_kv, "block_table": block_tables}
            for name, t in tables.items():
                _check(t.dtype == torch.int32, f"The datatype of {name} should be int32")
                _check(t.is_contiguous(), f"{name} must be contiguous")
            _check(query.dim() == 3 and output.shape == query.shape, "query and output are [tokens, heads, head_size]")
            _check(query.is_contiguous() and output.is_contiguous(), "query must be contiguous")
            _check(key_cache.shape == value_cache.shape, "key and value caches differ")
            if build == "xpu":
                key_cache = _convert_from_fp8(query.dtype, key_cache)
                value_cache = _convert_from_fp8(query.dtype, value_cache)
                _check(query.dtype in HALF, "XPU scaled_dot_product_efficient_attention only supports half, bfloat16")
                _check(key_cache.dtype == query.dtype, "The datatype of key should be the same as query")
                if query.shape[-1] % 64:
                    # IPEX pads the head dim to 64 over the pages in use, found with block_table.unique(): on a GPU
                    # its size comes back to the host, which no graph capture allows.
                    valid = torch.unique(block_tables)
                    _check(valid[-1].item() < key_cache.shape[0], "block table points past the cache")
            else:
                _check(query.dtype in KERNEL_DTYPES, f"Unsupported data type {query.dtype}")
                if key_cache.dtype != query.dtype:
                    _check(
                        key_cache.dtype == torch.float8_e5m2 and kv_cache_dtype in ("fp8", "fp8_e5m2"),
                        "only float8_e5m2 supported",
                    )
            _check(query.shape[-1] == key_cache.shape[-1], "query and cache head dims differ")
            _attention(
                build,
                output,
                query,
                key_cache,
                value_cache,
                cu_seqlens_q,
                cu_seqlens_kv,
                max_seqlen_q,
                max_seqlen_kv,
                scale,
                block_tables,
                window_size_left,
            )
            return output

    return PagedAttention


def _paged_store(build, key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype) -> None:
    _check(key.dim() == 3 and key.shape == value.shape, "key and value are [tokens, heads, head_size]")
    _check(key.stride(-1) == 1 and key.stride(-2) == key.shape[-1], "each token's heads must be contiguous")
    _check(value.stride(-1) == 1 and value.stride(-2) == value.shape[-1], "each token's heads must be contiguous")
    _check(slot_mapping.dtype in (torch.int32, torch.int64) and slot_mapping.dim() == 1, "slot_mapping int [tokens]")
    _check(slot_mapping.is_contiguous(), "slot_mapping should be contiguous")
    _check(key_cache.shape == value_cache.shape and key_cache.dtype == value_cache.dtype, "caches differ")
    _, _, kv_heads = _layout(key_cache, build)
    _check(kv_heads == key.shape[1] and key_cache.shape[-1] == key.shape[2], "the cache's heads or head dim differ")
    _cache_dtype_matches(key_cache, key.dtype, kv_cache_dtype, build)
    slots = slot_mapping.long()
    _store(key_cache, slots, key, build)
    _store(value_cache, slots, value, build)


def make_functional(build: str, calls: collections.Counter) -> types.SimpleNamespace:
    def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        _check(weight.dim() == 1 and weight.numel() == x.shape[-1], "weight must be [hidden]")
        _check(x.dtype in KERNEL_DTYPES and weight.dtype == x.dtype, f"x {x.dtype} and weight {weight.dtype}")
        x32 = x.float()
        # One rounding, at the end: the kernels accumulate and scale in float32.
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)

    def rms_norm(hidden_states, weight, eps):
        calls["rms_norm"] += 1
        return _norm(hidden_states, weight, eps)

    def add_rms_norm(residual, x, weight, bias, eps, add_back=False):
        calls["add_rms_norm"] += 1
        if build == "cpu":
            _check(bias is None, "bias is not supported in add_rmsnorm yet")
        _check(residual.shape == x.shape and residual.dtype == x.dtype, "residual and x differ")
        summed = x + residual
        if add_back:
            residual.copy_(summed)
        return _norm(summed, weight, eps)

    functional = types.SimpleNamespace(rms_norm=rms_norm, add_rms_norm=add_rms_norm)

    def silu_mul(x, y, out=None):
        calls["silu_mul"] += 1
        result = torch.nn.functional.silu(x) * y
        if out is not None:
            out.copy_(result)
        return result

    functional.silu_mul = silu_mul
    if build == "cpu":
        return functional

    def silu_and_mul(x, out=None):
        calls["silu_and_mul"] += 1
        if out is None:
            raise TypeError("empty(): argument 'size' must be tuple of ints, but found element of type float")
        d = x.shape[-1] // 2
        _check(out.shape == (*x.shape[:-1], d) and out.dtype == x.dtype, "out must be [..., d] in x's dtype")
        x32 = x.float()
        out.copy_((torch.nn.functional.silu(x32[..., :d]) * x32[..., d:]).to(x.dtype))
        return out

    def rotary_embedding_batched(
        positions, query, key, head_dim, cos_sin_cache, is_nexo_style, rotary_dim, offsets=None
    ):
        calls["rotary_embedding_batched"] += 1
        _check(offsets is None, "only the plain rotary embedding is faked")
        _check(rotary_dim in (32, 64, 96, 128, 256), f"wrong values for rotary_dim ({rotary_dim})")
        _check(rotary_dim == head_dim, f"rotary_dim ({rotary_dim})should be equal to head_size ({head_dim})")
        _check(positions.dtype == torch.int64, "positions must be int64")
        _check(cos_sin_cache.dtype == query.dtype == key.dtype, "expected scalar type of query for cos_sin_cache")
        _check(cos_sin_cache.shape[-1] == rotary_dim, "cos_sin_cache is [max_position, rot_dim]")
        for t in (query, key):
            _check(t.stride(-1) == 1, "query and key must have a contiguous last dim")
            tokens = t.shape[0]
            heads = t.view(tokens, -1, head_dim).float()
            cos, sin = cos_sin_cache[positions.view(-1)].float().chunk(2, dim=-1)
            if is_nexo_style:
                cos, sin = torch.cat((cos, cos), -1)[:, None], torch.cat((sin, sin), -1)[:, None]
                first, second = heads.chunk(2, dim=-1)
                rotated = heads * cos + torch.cat((-second, first), -1) * sin
            else:
                raise NotImplementedError("only NeoX style is faked")
            t.copy_(rotated.to(t.dtype).view(t.shape))
        return query, key

    functional.silu_and_mul = silu_and_mul
    functional.rotary_embedding_batched = rotary_embedding_batched
    return functional


def make_gated_mlp_moe(calls: collections.Counter, expert_offset: bool) -> type:
    """ipex.llm.modules.GatedMLPMOE of the XPU build: v2.8.10+xpu's, with v2.10.10+xpu's `experts_start_id` where
    `expert_offset`."""

    class GatedMLPMOE:
        expert_offset = False  # v2.10.10's experts_start_id
        fused_gemm_for_any_count = False  # v2.10.10's moe_gemm: XeTLA's persistent kernel for any expert count

        def __init__(
            self,
            W13,  # noqa: N803 - IPEX's argument names
            W2,  # noqa: N803
            W3=None,  # noqa: N803
            use_prepack=True,
            w1_scale_inv=None,
            w2_scale_inv=None,
            a1_scale_inv=None,
            a2_scale_inv=None,
        ):
            calls["GatedMLPMOE"] += 1
            _check(W3 is None, "only the fused W13 [E, 2I, H] is faked")
            scales = (w1_scale_inv, w2_scale_inv, a1_scale_inv, a2_scale_inv)
            _check(all(scale is None for scale in scales), "the fp8 scales are not faked")
            self.W13, self.W2, self.use_prepack = W13, W2, use_prepack
            self.experts_start_id = 0
            self.device_type = None

        def _init_on_device(self) -> None:
            # _IPEXGatedMLPMOEXPU.__init__: contiguous transposes, then the given tensors re-pointed at them.
            self.num_experts = self.W2.shape[0]
            self.W13_t = torch.transpose(self.W13, 1, 2).contiguous()  # [E, H, 2I]
            self.W2_t = torch.transpose(self.W2, 1, 2).contiguous()  # [E, I, H]
            self.W13.data = self.W13_t  # "delete original weight to avoid memory pressure"
            self.W2.data = self.W2_t

        def __call__(self, *args, **kwargs):
            return self.forward(*args, **kwargs)

        def forward(
            self,
            hidden_states,
            use_grouped_topk,
            top_k,
            router_logits,
            renormalize,
            topk_group=None,
            num_expert_group=None,
            custom_routing_function=None,
            scoring_func="softmax",
            e_score_correction_bias=None,
        ):
            calls["GatedMLPMOE.forward"] += 1
            if self.device_type != hidden_states.device.type:
                self.device_type = hidden_states.device.type
                self._init_on_device()
            _check(not use_grouped_topk and custom_routing_function is None, "only softmax top-k routing is faked")
            return _gated_mlp_moe(self, hidden_states, top_k, router_logits, renormalize)

    if not expert_offset:
        return GatedMLPMOE

    class GatedMLPMOEWithOffset(GatedMLPMOE):
        expert_offset = fused_gemm_for_any_count = True

        def __init__(
            self,
            W13,  # noqa: N803 - IPEX's argument names
            W2,  # noqa: N803
            W3=None,  # noqa: N803
            use_prepack=True,
            w1_scale_inv=None,
            w2_scale_inv=None,
            a1_scale_inv=None,
            a2_scale_inv=None,
            w13_bias=None,
            w2_bias=None,
            is_mxfp4=False,
            is_fp8=False,
            is_int4=False,
            experts_start_id=0,
        ):
            super().__init__(W13, W2, W3, use_prepack, w1_scale_inv, w2_scale_inv, a1_scale_inv, a2_scale_inv)
            _check(w13_bias is None and w2_bias is None, "expert biases are not faked")
            _check(not (is_mxfp4 or is_fp8 or is_int4), "quantized experts are not faked")
            self.experts_start_id = experts_start_id

    GatedMLPMOEWithOffset.__name__ = GatedMLPMOEWithOffset.__qualname__ = "GatedMLPMOE"
    return GatedMLPMOEWithOffset


def _gated_mlp_moe(module, hidden_states, top_k, router_logits, renormalize) -> torch.Tensor:
    """_IPEXGatedMLPMOEXPU.forward with the kernels' checks (csrc/gpu/aten/operators/MoeOps.cpp, moe_gemm.cpp)."""
    _check(router_logits.dim() == 2, f"gating_output must be 2D tensor, but got {router_logits.dim()}D")
    tokens, experts = router_logits.shape
    _check(experts <= 128, f"n_experts only support up to 128, but got {experts}")
    _check(router_logits.dtype in MOE_DTYPES, f"fused_topk_softmax_kernel not implemented for {router_logits.dtype}")
    _check(hidden_states.dim() == 2, f"activation must be 2D tensor, but got {hidden_states.dim()}D")
    _check(hidden_states.shape[0] == tokens, "Number of tokens mismatch")
    # The kernels index raw pointers as dense [tokens, ...] rows.
    _check(hidden_states.is_contiguous() and router_logits.is_contiguous(), "inputs must be contiguous")
    _check(top_k in MOE_TOP_KS, f"error: not support topk={top_k},")
    _check(0 < top_k <= experts, f"top_k {top_k} of {experts} experts")
    dtype, hidden = hidden_states.dtype, hidden_states.shape[1]
    _check(dtype in MOE_DTYPES, f"moe_scatter not implemented for {dtype}")
    local, w13, w2 = module.num_experts, module.W13_t, module.W2_t
    _check(local <= 256, "MoEScatter::GroupWorkItem is expected to be larger than num_expert")
    _check(hidden % (16 // hidden_states.element_size()) == 0, "n_channels is expected to be aligned to ElemsPerItem")
    _check(w13.dtype == dtype and w2.dtype == dtype, f"moe_gemm: weights {w13.dtype}/{w2.dtype} for {dtype} rows")
    _check(w13.dim() == 3 and w13.shape[1] == hidden, "matrix_b must have the same size as matrix_a in the second dim")
    inter = w13.shape[2] // 2
    _check(w2.shape == (local, inter, hidden), f"W2 {tuple(w2.shape)} does not follow W13 {tuple(w13.shape)}")
    # moe_gemm on a GPU with 2D block loads and XMX (the Max 1550 this fake stands for): XeTLA's grouped GEMM, for 8 or
    # 16 experts in v2.8.10 (any count from v2.10.10), whatever the dtype; it takes half and bfloat16 only.
    if module.fused_gemm_for_any_count or local in (8, 16):
        _check(dtype in HALF, "Error in moegemm: run into Unsupported data type, only support half and bfloat16 now.")
    start = module.experts_start_id
    if module.expert_offset:  # v2.10.10: slots of experts outside start .. start + local - 1 are skipped
        _check(0 <= start and start + local <= experts, f"experts {start}.. of {local} beyond the logits' {experts}")
    else:  # v2.8.10: topk_softmax counts rows for every column of the logits, moe_scatter for the module's experts
        _check(experts == local, f"logits over {experts} experts for a module of {local} (no experts_start_id)")
    # topk_softmax: the top_k largest logits, their softmax over all experts, in float32.
    weights, ids = torch.topk(torch.softmax(router_logits.float(), dim=-1), top_k, dim=-1)
    if renormalize:  # moe_gather, before the sum: over all top_k weights, other ranks' included
        total = weights.sum(dim=-1, keepdim=True)
        weights = torch.where(total > 0, weights / total, weights)
    local_ids = ids - start
    mine = (local_ids >= 0) & (local_ids < local)
    # rows_for_experts.to("cpu"): each expert's row count on the host, read as moe_gemm's per-expert loop reads them
    # (`rows_for_experts_cpu[i].item()`; the fused kernel computes its launch range from them).
    rows_for_experts = torch.bincount(local_ids[mine], minlength=local)
    counts = [rows_for_experts[expert].item() for expert in range(local)]
    out = torch.zeros(tokens, hidden, dtype=torch.float32, device=hidden_states.device)
    for expert, count in enumerate(counts):
        if not count:
            continue
        rows, slots = torch.where(mine & (local_ids == expert))
        gate_up = hidden_states[rows] @ w13[expert]  # moe_gemm: [rows, 2I] in the activations' dtype
        gate, up = gate_up.float().chunk(2, dim=-1)
        down = (torch.nn.functional.silu(gate) * up).to(dtype) @ w2[expert]  # silu_and_mul, then moe_gemm
        out.index_add_(0, rows, down.float() * weights[rows, slots, None])  # moe_gather: float32, rounded once
    return out.to(dtype)


class QuantMethod(enum.IntEnum):  # llm/quantization/utils.py
    GPTQ_GEMM = 0
    AWQ_GEMM = 1


class QuantDtype(enum.IntEnum):
    INT4 = 0
    FP8_E5M2 = 1
    FP8_E4M3FN = 2


AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ: nibble i of word j holds column 8j + AWQ_ORDER[i]
NIBBLE_SHIFTS = tuple(range(0, 32, 4))


def _nibbles(words: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 words -> their eight 4-bit fields (lowest first) spread along `dim` (8x longer), as int64."""
    shifts = torch.tensor(NIBBLE_SHIFTS, device=words.device)
    fields = (words.long().unsqueeze(-1) >> shifts) & 0xF  # [..., words, 8]
    if dim == 0:  # along the rows: row 8r + i from field i of row r
        return fields.permute(0, 2, 1).reshape(-1, words.shape[1])
    return fields.reshape(words.shape[0], -1)


def _words(fields: torch.Tensor, dim: int) -> torch.Tensor:
    """4-bit values -> int32 words of eight along `dim`, the lowest bits first (the inverse of _nibbles)."""
    shifts = torch.tensor(NIBBLE_SHIFTS, device=fields.device)
    if dim == 0:
        grouped = fields.long().view(-1, 8, fields.shape[1]) << shifts[None, :, None]
        words = grouped.sum(1)
    else:
        words = (fields.long().view(fields.shape[0], -1, 8) << shifts).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _from_awq_order(fields: torch.Tensor) -> torch.Tensor:
    """[R, C] fields read from AWQ words (field i of word j at column 8j + i) -> column 8j + AWQ_ORDER[i] in place."""
    out = torch.empty_like(fields)
    out.view(fields.shape[0], -1, 8)[:, :, list(AWQ_ORDER)] = fields.view(fields.shape[0], -1, 8)
    return out


def make_quantization(calls: collections.Counter) -> types.SimpleNamespace:
    """ipex.llm.quantization of the XPU build (v2.8.10+xpu: llm/quantization/woq_linear.py, and the XPU module of
    nn/utils/_quantize_convert.py), int4 with the AWQ method only."""

    class IPEXWeightOnlyQuantizedLinear:
        def __init__(self, qweight, scales, qzeros, group_size, bias):
            self.qweight, self.scales, self.qzeros = qweight, scales, qzeros
            self.blocksize, self.bias = group_size, bias

        @classmethod
        def from_weight(
            cls,
            qweight,
            scales,
            zero_points,
            in_features,
            out_features,
            qconfig=None,
            bias=None,
            group_size=-1,
            g_idx=None,
            quant_method=QuantMethod.GPTQ_GEMM,
            dtype=QuantDtype.INT4,
            **kwargs,
        ):
            calls["IPEXWeightOnlyQuantizedLinear.from_weight"] += 1
            _check(qweight.device.type in {"cpu", "xpu"}, "Device type not supported.")
            _check(dtype == QuantDtype.INT4, "only int4 weights are faked")
            _check(quant_method == QuantMethod.AWQ_GEMM, "only the AWQ method is faked (GPTQ drops asymmetric zeros)")
            _check(g_idx is None and qconfig is None, "act order and qconfigs are not faked")
            group = in_features if group_size == -1 else group_size
            _check(in_features % group == 0, "int4 dequantize: reduce-dim must be divisible by group size.")
            groups, packed_n = in_features // group, out_features // 8
            _check(out_features % 8 == 0, "AWQ packs eight outputs a word")
            _check(qweight.dtype == torch.int32 and qweight.shape == (in_features, packed_n), "AWQ qweight [K, N/8]")
            _check(scales.dtype in (torch.float16, torch.float32), "scale_dtype only support 'fp32', 'fp16'. now.")
            _check(scales.shape == (groups, out_features), "AWQ scales are [K / group_size, N]")
            _check(zero_points is not None, "AWQ needs its zero points")
            _check(zero_points.dtype == torch.int32 and zero_points.shape == (groups, packed_n), "AWQ qzeros")
            # fast_awq_to_gptq: the weight repacked along K ([K / 8, N]), the zeros along N in natural order, both
            # written into the tensors given (set_weights_bias wraps qweight without a copy; `.data.copy_`).
            values = _from_awq_order(_nibbles(qweight, dim=1))
            zeros = _from_awq_order(_nibbles(zero_points, dim=1))
            qweight.view(-1).copy_(_words(values, dim=0).view(-1))
            zero_points.copy_(_words(zeros, dim=1))
            return cls(qweight.view(in_features // 8, out_features), scales, zero_points, group, bias)

        def __call__(self, x, bias=None, **kwargs):
            return self.forward(x, bias, **kwargs)

        def forward(self, x, bias=None, **kwargs):
            calls["IPEXWeightOnlyQuantizedLinear.forward"] += 1
            _check(x.dtype in HALF, f"XeTLA computes {x.dtype} rows in half (XEGEMM_INT4.cpp): not faked")
            _check(x.dim() in (2, 3) and x.shape[-1] == self.qweight.shape[0] * 8, "x is [..., in_features]")
            # bias: the XPU module's forward ignores it for int4 (it reads the bias given to from_weight).
            group = torch.arange(self.qweight.shape[0] * 8, device=x.device) // self.blocksize
            zeros = _nibbles(self.qzeros, dim=1)[group]
            weight = (_nibbles(self.qweight, dim=0) - zeros).float() * self.scales.float()[group]  # [K, N]
            out = x.float() @ weight
            if self.bias is not None:
                out = out + self.bias.float()
            return out.to(x.dtype)  # float32 accumulation, one rounding

    return types.SimpleNamespace(
        IPEXWeightOnlyQuantizedLinear=IPEXWeightOnlyQuantizedLinear, QuantMethod=QuantMethod, QuantDtype=QuantDtype
    )


def make_fp8_gemm(calls: collections.Counter):
    """torch.ops.torch_ipex.fp8_gemm_w8a16 (csrc/gpu/aten/operators/fp8/FP8Linear.cpp, oneDNN's w8a16 matmul)."""

    def fp8_gemm_w8a16(A, B, trans_B, B_scale=None, bias=None):  # noqa: N803 - IPEX's argument names
        calls["fp8_gemm_w8a16"] += 1
        _check(isinstance(trans_B, bool), "trans_B is a bool")
        _check(B.dtype in (torch.float8_e5m2, torch.float8_e4m3fn), "weight must be f8_e5m2 or f8_e4m3fn")
        _check(A.dtype in HALF, f"Unsupported data type for fp8 matmul: {A.dtype}")
        _check(A.dim() in (2, 3), "linear only support for 2D and 3D tensors!")
        _check(B.dim() == 2, "fp8_gemm only support 2D weight")
        _check(A.stride(-1) == 1, "rows are read by their leading stride: the last dim must be contiguous")
        weight = B if trans_B else B.t()  # [N, K]
        _check(weight.shape[1] == A.shape[-1], f"K of A {A.shape[-1]} and of the weight {weight.shape[1]} differ")
        scale = torch.ones(1) if B_scale is None else B_scale
        # oneDNN's mask 0 ("only for per-tensor scaling"): a longer tensor would be read as its first element.
        _check(scale.numel() == 1, f"one scale per weight, got {tuple(scale.shape)}")
        _check(scale.dtype in KERNEL_DTYPES, f"scale dtype {scale.dtype}")
        out = A.float() @ (weight.float() * scale.float().to(A.device)).t()
        if bias is not None:
            _check(bias.numel() == weight.shape[0] and bias.dtype in KERNEL_DTYPES, "unsupported bias in matmul")
            out = out + bias.float()
        return out.to(A.dtype)

    return fp8_gemm_w8a16


def matching_version(build: str) -> str:
    """An IPEX version that matches this torch: X.Y.10+xpu (how Intel numbers its XPU builds) or X.Y.0+cpu."""
    major_minor = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    return f"{major_minor}.10+xpu" if build == "xpu" else f"{major_minor}.0+cpu"


def make_ipex(build: str = "xpu", version: str | None = None) -> types.ModuleType:
    """A module to put in sys.modules as intel_extension_for_pytorch (its distribution metadata is separate)."""
    module = types.ModuleType("intel_extension_for_pytorch")
    module.__spec__ = importlib.machinery.ModuleSpec("intel_extension_for_pytorch", None)
    module.__version__ = version or matching_version(build)
    module.calls = collections.Counter()
    module.build = build
    llm = types.SimpleNamespace(
        modules=types.SimpleNamespace(PagedAttention=make_paged_attention(build, module.calls)),
        functional=make_functional(build, module.calls),
    )
    module.torch_ops = {}  # what the installers put on torch.ops.torch_ipex
    if build == "xpu":
        major, minor = (int(part) for part in module.__version__.split(".")[:2])
        llm.modules.GatedMLPMOE = make_gated_mlp_moe(module.calls, expert_offset=(major, minor) >= (2, 10))
        if (major, minor) >= (2, 5):
            llm.quantization = make_quantization(module.calls)
        if (major, minor) >= (2, 8):
            module.torch_ops["fp8_gemm_w8a16"] = make_fp8_gemm(module.calls)
    module.llm = llm
    return module


def install_metadata(root: Any, version: str) -> None:
    """Write intel-extension-for-pytorch's .dist-info under `root` (put it on sys.path): what pip leaves behind,
    and what omnirun reads to compare IPEX's version with torch's without importing it."""
    from pathlib import Path

    dist_info = Path(root) / f"intel_extension_for_pytorch-{version}.dist-info"
    dist_info.mkdir(parents=True, exist_ok=True)
    (dist_info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: intel-extension-for-pytorch\nVersion: {version}\n"
    )
