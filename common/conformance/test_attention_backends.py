"""Every attention backend the device offers equals torch_native (the reference) on random paged KV: page sizes 1
and 16, GQA, a sliding window, every KV dtype the device stores, prefill with a cached prefix, and decode."""

from __future__ import annotations

import pytest
import torch

from omnirun.attention.backend import AttentionContext, AttentionLayerSpec
from omnirun.attention.torch_native import TorchNativeAttention
from omnirun.batch import build_batch
from omnirun.errors import ConfigError
from omnirun.memory import KVMemory, PageAllocator, PagedKVCache, ReqToTokenPool
from omnirun.testing import fill_prefixes

CONTEXT_LEN = 160
# (page size, query heads, KV heads, sliding window)
SHAPES = [(1, 4, 4, None), (16, 8, 2, None), (16, 14, 2, 24), (1, 8, 1, 9)]
HEAD_DIM = 64


def _backends_under_test(platform) -> list[str]:
    others = [name for name in platform.attention_backends() if name != TorchNativeAttention.name]
    if not others:
        pytest.skip(f"{platform.name} offers no attention backend besides torch_native")
    return others


def _kv_dtypes(platform, model_dtype: torch.dtype) -> list[torch.dtype]:
    caps = platform.capabilities
    return [model_dtype] + [d for d in (caps.fp8_e4m3_dtype, caps.fp8_e5m2_dtype) if d is not None]


def _setup(platform, page_size, heads, kv_heads, window, model_dtype, kv_dtype, seed):
    torch.manual_seed(seed)
    device = platform.device()
    num_pages = 1200 // page_size
    slots = (num_pages + 1) * page_size
    cache = PagedKVCache(1, slots, kv_heads, HEAD_DIM, kv_dtype, device, page_size)
    for buf in cache.k_buffers + cache.v_buffers:
        buf[page_size:] = torch.randn(slots - page_size, kv_heads, HEAD_DIM, device=device).to(kv_dtype)
    kv = KVMemory(PageAllocator(num_pages, page_size), ReqToTokenPool(6, CONTEXT_LEN, device), cache, page_size)
    context = AttentionContext(kv, device, model_dtype, heads, kv_heads, HEAD_DIM, max_context_len=CONTEXT_LEN)
    layer = AttentionLayerSpec(0, heads, kv_heads, HEAD_DIM, 0.8 / HEAD_DIM**0.5, window)
    return kv, context, layer


PREFIX_LENS = [0, 9, 61, 133]  # nothing cached, short, several pages, long enough for split decode kernels


def _forward(platform, make_backend, shape, model_dtype, kv_dtype, new_lens):
    """One forward of a backend over requests holding PREFIX_LENS cached tokens; the same cache and q/k/v for every
    backend (all drawn from fixed seeds)."""
    page_size, heads, kv_heads, window = shape
    kv, context, layer = _setup(platform, page_size, heads, kv_heads, window, model_dtype, kv_dtype, seed=3)
    rows = fill_prefixes(kv, PREFIX_LENS)
    gen = torch.Generator().manual_seed(7)
    q, k, v = (
        torch.randn(sum(new_lens), n * HEAD_DIM, generator=gen).to(context.device, model_dtype)
        for n in (heads, kv_heads, kv_heads)
    )
    batch = build_batch(kv, rows, PREFIX_LENS, [[1] * n for n in new_lens], context.device)
    backend = make_backend(context)
    backend.init_forward_metadata(batch)
    return backend.forward(q, k, v, layer, batch)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"ps{s[0]}-h{s[1]}/{s[2]}-w{s[3]}")
def test_every_backend_equals_torch_native(platform, shape):
    names = _backends_under_test(platform)
    model_dtype = platform.capabilities.model_dtypes[0]
    tolerance = 1e-4 if model_dtype == torch.float32 else 3e-2
    for kv_dtype in _kv_dtypes(platform, model_dtype):
        for mode, new_lens in (("extend", [5, 1, 17, 9]), ("decode", [1, 1, 1, 1])):
            reference = _forward(platform, TorchNativeAttention, shape, model_dtype, kv_dtype, new_lens)
            for name in names:
                try:
                    build = platform.attention_offer(name).build
                    got = _forward(platform, build, shape, model_dtype, kv_dtype, new_lens)
                except ConfigError as exc:
                    # A backend may refuse an fp8 flavour its kernels cannot read (aiter: no e5m2), at build time
                    # and with the flag that fixes it; the model dtype it must always serve.
                    if kv_dtype == model_dtype or "--kv-cache-dtype" not in str(exc):
                        raise
                    continue
                assert got.shape == reference.shape and torch.isfinite(got).all(), (name, mode)
                torch.testing.assert_close(
                    got.float(), reference.float(), atol=tolerance, rtol=tolerance, msg=f"{name} {mode} {kv_dtype}"
                )
