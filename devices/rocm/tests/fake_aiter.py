"""A fake `aiter` for tests without an AMD GPU: aiter's Python API, computed with plain torch on CPU tensors.

It follows the signatures of ROCm/aiter@e4048607a5 (aiter/ops/attention.py::paged_attention_ragged over
csrc/cpp_itfs/pa/pa_ragged.py, aiter/ops/mha.py::flash_attn_varlen_func, aiter/ops/rmsnorm.py::rms_norm and
rmsnorm2d_fwd_with_add, aiter/utility/dtypes.py::fp8; the fp8 GEMMs and quantizers in fake_aiter_fp8.py) and
refuses what the real kernels refuse or would read wrongly: queries outside fp16/bf16, a kv_cache_dtype other than
auto/fp8/fp8_e4m3 (no e5m2), fp8 bytes in another encoding than the GPU's (e4m3fnuz on gfx942, e4m3fn on gfx950),
KV caches whose layout or strides disagree with the layout named, tables that are not int32, a workspace smaller
than the kernel's. Where a real kernel silently computes something else (a partition count too small for a
context), the fake computes that same wrong thing, so a test sees it.

The decode kernel reads no host value, so it records and replays inside `omnirun_fakes.device`'s graphs.
"""

from __future__ import annotations

import collections
import importlib.machinery
import types

import torch
from fake_aiter_fp8 import fp8_api
from fake_aiter_moe import ActivationType, moe_module

HALF = (torch.bfloat16, torch.float16)
NORM_DTYPES = (*HALF, torch.float32)
# aiter.dtypes.fp8 per target (ROCm/aiter:aiter/utility/dtypes.py::defaultDtypes).
FP8_BY_GFX = {"gfx942": torch.float8_e4m3fnuz, "gfx950": torch.float8_e4m3fn}


class AiterCheckError(RuntimeError):
    """What aiter's AITER_CHECK / TORCH_CHECK raise on arguments its kernels cannot take."""


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise AiterCheckError(message)


def make_aiter(gfx: str = "gfx942") -> types.ModuleType:
    """A fresh fake `aiter` module for one GPU target; `module.calls` counts the kernels run."""
    e4m3 = FP8_BY_GFX[gfx]
    module = types.ModuleType("aiter", "fake aiter (omnirun tests)")
    module.__spec__ = importlib.machinery.ModuleSpec("aiter", loader=None)
    module.calls = collections.Counter()
    dtypes = types.ModuleType("aiter.dtypes")
    dtypes.fp8 = e4m3
    module.dtypes = dtypes
    # pa_ragged.py maps "fp8" and "fp8_e4m3" to uint8 bytes its kernel decodes as this GPU's e4m3; nothing else.
    fp8 = {"fp8": e4m3, "fp8_e4m3": e4m3}

    def counted(fn):
        def call(*args, **kwargs):
            module.calls[fn.__name__] += 1
            return fn(*args, **kwargs)

        call.__name__ = fn.__name__
        return call

    def paged_attention_ragged(*args, **kwargs):
        return _paged_attention_ragged(fp8, *args, **kwargs)

    paged_attention_ragged.__name__ = "paged_attention_ragged"
    for fn in (paged_attention_ragged, flash_attn_varlen_func, rms_norm, rmsnorm2d_fwd_with_add):
        setattr(module, fn.__name__, counted(fn))
    for name, value in fp8_api(e4m3, _require, counted).items():  # the fp8 GEMMs (fake_aiter_fp8.py)
        setattr(module, name, value)
    module.ActivationType = ActivationType
    module.fused_moe = moe_module(_require, counted)  # fake_aiter_moe.py; importable once installed (`modules`)
    return module


def modules(module: types.ModuleType) -> dict[str, types.ModuleType]:
    """The sys.modules entries that make a fake aiter importable, `from aiter.fused_moe import fused_moe` too."""
    return {"aiter": module, "aiter.fused_moe": module.fused_moe}


# --- paged decode ---
def _kv_values(cache: torch.Tensor, kv_cache_dtype: str, query_dtype: torch.dtype, fp8: dict) -> torch.Tensor:
    """The cache as the kernel reads it, in float32 (before the per-tensor scale)."""
    if kv_cache_dtype == "auto":
        _require(cache.dtype == query_dtype, f"kv_cache_dtype 'auto' reads a {query_dtype} cache, got {cache.dtype}")
        return cache.float()
    if kv_cache_dtype not in fp8:
        raise ValueError(f"Unsupported kv_cache_dtype: {kv_cache_dtype}")  # pa_ragged.py raises ValueError
    flavour = fp8[kv_cache_dtype]
    # The kernel takes fp8 as bytes (uint8_t) and decodes them in this GPU's encoding.
    _require(
        cache.dtype in (torch.uint8, flavour),
        f"kv_cache_dtype {kv_cache_dtype!r} decodes {flavour} bytes on this GPU; the cache holds {cache.dtype}",
    )
    return cache.view(flavour).float()


def _check_int32(name: str, t: torch.Tensor, device: torch.device) -> None:
    _require(t.dtype == torch.int32, f"{name} must be int32, got {t.dtype}")
    _require(t.dim() == 1 and t.stride(0) == 1, f"{name} must be a contiguous 1-D tensor")
    _require(t.device == device, f"{name} is on {t.device}, the query on {device}")


def _paged_attention_ragged(
    fp8,
    out,
    workspace_buffer,
    query,
    key_cache,
    value_cache,
    scale,
    kv_indptr,
    kv_page_indices,
    kv_last_page_lens,
    block_size,
    max_num_partitions,
    alibi_slopes,
    kv_cache_dtype,
    kv_cache_layout,
    logits_soft_cap,
    k_scale,
    v_scale,
    fp8_out_scale=None,
    partition_size=256,
    mtp=1,
):
    # pa_ragged.py raises ValueError for these before compiling a kernel.
    if query.dtype not in HALF:
        raise ValueError(f"Unsupported data type: {query.dtype}")
    if out.dtype not in HALF:
        raise ValueError(f"Unsupported data type: {out.dtype}")
    _require(alibi_slopes is None and fp8_out_scale is None and mtp == 1, "not faked: alibi, fp8 out, mtp")
    _require(query.dim() == 3, f"query must be [seqs, heads, head_size], got {tuple(query.shape)}")
    batch, heads, head_size = query.shape
    # The kernel takes one row stride for the query: heads and head elements must be packed within a row.
    _require(query.stride(2) == 1 and query.stride(1) == head_size, "query rows must hold packed heads")
    _require(out.shape == query.shape and out.is_contiguous(), "out must be a contiguous tensor shaped like query")
    _require(kv_cache_layout in ("NHD", "HND"), f"unknown kv_cache_layout {kv_cache_layout!r}")
    _require(key_cache.dim() == 4 and value_cache.shape == key_cache.shape, "key/value caches must be 4-D, equal")
    # One set of strides (taken from key_cache) addresses both caches.
    _require(value_cache.stride() == key_cache.stride(), "key and value caches must share strides")
    _require(key_cache.stride(3) == 1, "the head_size dimension of the caches must be contiguous")
    if kv_cache_layout == "NHD":
        _, page, kv_heads, dim = key_cache.shape
    else:
        _, kv_heads, page, dim = key_cache.shape
    _require(page == block_size, f"{kv_cache_layout} cache of pages of {page} tokens read with block_size {block_size}")
    _require(dim == head_size, f"cache head_size {dim} != query head_size {head_size}")
    _require(heads % kv_heads == 0, f"{heads} query heads do not group over {kv_heads} KV heads")
    device = query.device
    for name, t in (("kv_indptr", kv_indptr), ("kv_page_indices", kv_page_indices)):
        _check_int32(name, t, device)
    _require(kv_indptr.shape[0] == batch + 1, f"kv_indptr must be [{batch + 1}], got {tuple(kv_indptr.shape)}")
    if block_size > 1:
        _check_int32("kv_last_page_lens", kv_last_page_lens, device)
        _require(kv_last_page_lens.shape[0] == batch, "kv_last_page_lens must hold one length per sequence")
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        _require(s.dtype == torch.float32 and s.numel() == 1 and s.device == device, f"{name}: float32 [1] tensor")
    # pa_ragged.cpp.jinja: fp32 exp-sums and max-logits, then partial outputs in the query dtype, per partition.
    needed = batch * heads * max_num_partitions * (8 + head_size * query.element_size())
    _require(workspace_buffer.numel() * workspace_buffer.element_size() >= needed, "workspace_buffer too small")
    _require(workspace_buffer.device == device and workspace_buffer.is_contiguous(), "workspace_buffer: contiguous")

    # The kernel runs max_num_partitions partitions of partition_size keys: keys beyond them are never read.
    limit = max_num_partitions * partition_size
    starts = kv_indptr[:-1].long()
    pages_held = (kv_indptr[1:] - kv_indptr[:-1]).long()
    if block_size > 1:
        tokens = torch.where(pages_held > 0, (pages_held - 1) * block_size + kv_last_page_lens.long(), 0)
    else:
        tokens = pages_held
    j = torch.arange(limit, device=device)
    valid = j[None, :] < tokens[:, None]  # [batch, limit]
    where = torch.where(valid, starts[:, None] + j[None, :] // block_size, 0).clamp(max=kv_page_indices.numel() - 1)
    pages, offsets = kv_page_indices.long()[where], (j % block_size)[None, :].expand(batch, limit)
    if kv_cache_layout == "NHD":
        keys, values = key_cache[pages, offsets], value_cache[pages, offsets]
    else:
        keys, values = key_cache[pages, :, offsets], value_cache[pages, :, offsets]
    keys = _kv_values(keys, kv_cache_dtype, query.dtype, fp8) * k_scale  # [batch, limit, kv_heads, head_size]
    values = _kv_values(values, kv_cache_dtype, query.dtype, fp8) * v_scale
    q = query.float().view(batch, kv_heads, heads // kv_heads, head_size)
    scores = torch.einsum("bhgd,blhd->bhgl", q, keys) * scale
    if logits_soft_cap:
        scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    o = torch.einsum("bhgl,blhd->bhgd", scores.softmax(dim=-1), values)
    out.copy_(o.reshape(batch, heads, head_size))
    return out


# --- varlen prefill ---
def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    min_seqlen_q=0,
    dropout_p=0.0,
    softmax_scale=None,
    logits_soft_cap=0.0,
    causal=False,
    window_size=(-1, -1, 0),
    bias=None,
    alibi_slopes=None,
    deterministic=False,
    return_lse=False,
    return_attn_probs=False,
    how_v3_bf16_cvt=1,
    block_table=None,
    out=None,
    cu_seqlens_q_padded=None,
    cu_seqlens_k_padded=None,
    sink_ptr=None,
):
    _require(q.dtype in HALF and k.dtype == q.dtype and v.dtype == q.dtype, "q, k, v must share one of fp16/bf16")
    _require(q.dim() == k.dim() == v.dim() == 3, "q, k, v must be [tokens, heads, head_size]")
    _require(all(t.stride(-1) == 1 for t in (q, k, v)), "q, k, v must have a contiguous last dimension")
    _require(k.shape[:2] == v.shape[:2] and q.shape[2] == k.shape[2], "q/k/v head sizes or lengths differ")
    _require(q.shape[1] % k.shape[1] == 0, f"{q.shape[1]} query heads do not group over {k.shape[1]} KV heads")
    _require(dropout_p == 0.0 and block_table is None and bias is None and alibi_slopes is None, "not faked")
    _require(len(window_size) in (2, 3), "window_size is (left, right) or (left, right, sink)")
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        _check_int32(name, t, q.device)
    _require(cu_seqlens_q.shape == cu_seqlens_k.shape, "cu_seqlens_q and cu_seqlens_k describe different batches")
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()  # eager only: never inside a graph
    _require(bounds_q[-1] == q.shape[0] and bounds_k[-1] <= k.shape[0], "cu_seqlens overrun q or k")
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    left, right = window_size[0], window_size[1]
    result = torch.empty_like(q) if out is None else out
    lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
    for i in range(len(bounds_q) - 1):
        q0, q1, k0, k1 = bounds_q[i], bounds_q[i + 1], bounds_k[i], bounds_k[i + 1]
        # The grid is sized from the max lengths: a longer sequence would be cut short on the GPU.
        _require(q1 - q0 <= max_seqlen_q and k1 - k0 <= max_seqlen_k, "a sequence exceeds max_seqlen_q/k")
        qi = q[q0:q1].float().transpose(0, 1)  # [heads, lq, d]
        ki = k[k0:k1].float().transpose(0, 1).repeat_interleave(q.shape[1] // k.shape[1], 0)
        vi = v[k0:k1].float().transpose(0, 1).repeat_interleave(q.shape[1] // k.shape[1], 0)
        scores = qi @ ki.transpose(1, 2) * scale
        if logits_soft_cap:
            scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
        # Causal and windows align to the bottom right: query r sits at key position (lk - lq + r).
        pos = torch.arange(q1 - q0, device=q.device)[:, None] + (k1 - k0) - (q1 - q0)
        key = torch.arange(k1 - k0, device=q.device)[None, :]
        keep = torch.ones_like(key == pos)
        if causal:
            keep &= key <= pos
        if left >= 0:
            keep &= key >= pos - left
        if right >= 0:
            keep &= key <= pos + right
        scores = scores.masked_fill(~keep, float("-inf"))
        lse[:, q0:q1] = scores.logsumexp(-1)
        result[q0:q1] = (scores.softmax(-1) @ vi).transpose(0, 1).to(q.dtype)
    return (result, lse) if return_lse else result


# --- norms ---
def _check_rows(name: str, x: torch.Tensor, weight: torch.Tensor) -> None:
    # rmsnorm.py::_check: fp16/bf16/fp32 (the opus kernels), contiguous input and weight, weight of input's dtype.
    _require(x.dtype in NORM_DTYPES, f"{name}: fp16/bf16/fp32 only, got {x.dtype}")
    _require(x.dim() == 2 and x.is_contiguous(), f"{name}: input must be a contiguous [rows, hidden] tensor")
    _require(weight.dtype == x.dtype, f"{name}: weight dtype {weight.dtype} != input dtype {x.dtype}")
    _require(weight.is_contiguous() and weight.shape == x.shape[-1:], f"{name}: weight must be [{x.shape[-1]}]")


def _normed(x32: torch.Tensor, weight: torch.Tensor, epsilon: float) -> torch.Tensor:
    """The kernels compute in float32 and round once, when they store."""
    return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + epsilon) * weight.float()


def rms_norm(input, weight, epsilon, use_model_sensitive_rmsnorm=0):
    _require(not use_model_sensitive_rmsnorm, "not faked: model-sensitive norm")
    _check_rows("rms_norm", input, weight)
    return _normed(input.float(), weight, epsilon).to(input.dtype)


def rmsnorm2d_fwd_with_add(
    out, input, residual_in, residual_out, weight, epsilon, gemma_norm=False, use_model_sensitive_rmsnorm=0
):
    _require(not gemma_norm and not use_model_sensitive_rmsnorm, "not faked: gemma / model-sensitive norms")
    _check_rows("rmsnorm2d_fwd_with_add", input, weight)
    for name, t in (("out", out), ("residual_in", residual_in), ("residual_out", residual_out)):
        _require(t.shape == input.shape and t.dtype == input.dtype and t.is_contiguous(), f"{name} must match input")
    summed = input.float() + residual_in.float()
    residual_out.copy_(summed.to(input.dtype))
    out.copy_(_normed(residual_out.float(), weight, epsilon).to(input.dtype))
