"""A fake `intel_extension_for_pytorch` for tests without Intel hardware: the calls omnirun makes, with IPEX's
documented semantics in plain torch on CPU tensors, and as strict about shapes, dtypes and layouts as the real ops.

`make_ipex("xpu")` follows the XPU build (v2.8.10+xpu), whose kernels the host stands in for: NHD caches
[pages, page_size, kv_heads, head_dim], contiguous; int32 cu_seqlens and block tables; bf16/fp16 attention only;
head dims not a multiple of 64 padded through block_table.unique() (a device sync on a real GPU, so a host read
here, which a graph capture refuses). `make_ipex("cpu")` follows the CPU build (v2.8.0+cpu): caches read through
strides as [pages, kv_heads, page_size, head_dim], fp8 only as e5m2, no silu_and_mul / rotary_embedding_batched.

The attention math runs without any host read (batches are padded to the max lengths IPEX is given), so it can be
recorded by omnirun_fakes.device's RecordingGraph like a kernel in a device graph. `calls` counts each entry point.
"""

from __future__ import annotations

import collections
import importlib.machinery
import types
from typing import Any

import torch

HALF = (torch.bfloat16, torch.float16)
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


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
