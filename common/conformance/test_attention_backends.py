"""Every attention backend the device offers equals torch_native (the reference) on random paged KV: page sizes 1
and 16, GQA, a sliding window, every KV dtype the device stores, prefill with a cached prefix, and decode; and an
fp8 cache with per-layer k/v scales reads, through every backend, as the values it stands for."""

from __future__ import annotations

import pytest
import torch

from omnirun.attention.backend import AttentionContext, AttentionLayerSpec
from omnirun.attention.torch_native import TorchNativeAttention
from omnirun.batch import build_batch
from omnirun.errors import ConfigError
from omnirun.layers.attention import PagedAttention
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


# Neither power of two: a store that skips the division, or a read that skips a scale, is off by a visible factor.
KV_SCALES = (0.75, 1.6)


@pytest.mark.parametrize("mode", ["extend", "decode"])
def test_a_scaled_fp8_cache_reads_as_the_values_it_stands_for(platform, mode):
    """An fp8 cache with a layer's k_scale and v_scale, read and written by each backend (torch_native included)
    through the attention layer, gives what torch_native gives on a cache in the model dtype holding the
    dequantized values (stored x scale): the cached prefix, and the step's own K/V stored as fp8(k / k_scale)."""
    caps = platform.capabilities
    fp8 = [d for d in (caps.fp8_e4m3_dtype, caps.fp8_e5m2_dtype) if d is not None]
    if not fp8:
        pytest.skip(f"{platform.name} stores no fp8 KV cache")
    model_dtype = caps.model_dtypes[0]
    tolerance = 1e-4 if model_dtype == torch.float32 else 3e-2
    shape = SHAPES[1]
    new_lens = [5, 1, 17, 9] if mode == "extend" else [1, 1, 1, 1]
    gen = torch.Generator().manual_seed(7)
    # float32 on the host: the reference's stored values are computed from them
    q, k, v = (torch.randn(sum(new_lens), n * HEAD_DIM, generator=gen) for n in (shape[1], shape[2], shape[2]))
    for kv_dtype in fp8:
        # The reference: a model-dtype cache holding the dequantized prefix, and the new tokens as fp8 rounds them.
        scaled = _scaled_cache(platform, shape, model_dtype, kv_dtype)[0]
        kv, context, layer = _setup(platform, *shape, model_dtype, model_dtype, seed=3)
        for plain, stored, scale in zip(
            kv.kv_cache.k_buffers + kv.kv_cache.v_buffers,
            scaled.kv_cache.k_buffers + scaled.kv_cache.v_buffers,
            (KV_SCALES[0], KV_SCALES[1]),
            strict=True,
        ):
            plain.copy_(stored.float() * scale)
        k_ref, v_ref = (  # the step's K/V reach the cache in the model dtype, then are divided in float32
            (t.to(model_dtype).float() / s).to(kv_dtype).float() * s for t, s in ((k, KV_SCALES[0]), (v, KV_SCALES[1]))
        )
        expected = _layer_forward(TorchNativeAttention, kv, context, layer, new_lens, (q, k_ref, v_ref))
        for name in [TorchNativeAttention.name, *platform.attention_backends()]:
            build = TorchNativeAttention if name == TorchNativeAttention.name else platform.attention_offer(name).build
            try:
                got = _layer_forward(build, *_scaled_cache(platform, shape, model_dtype, kv_dtype), new_lens, (q, k, v))
            except ConfigError as exc:
                if "--kv-cache-dtype" not in str(exc):  # a backend may refuse an fp8 flavour, saying so
                    raise
                continue
            torch.testing.assert_close(
                got.float(),
                expected.float(),
                atol=tolerance,
                rtol=tolerance,
                msg=lambda m, what=f"{name} {mode} {kv_dtype}": f"{what}: {m}",
            )


def _scaled_cache(platform, shape, model_dtype, kv_dtype):
    """_setup's random cache (the same contents at every call) in `kv_dtype`, with KV_SCALES."""
    kv, context, layer = _setup(platform, *shape, model_dtype, kv_dtype, seed=3)
    kv.kv_cache.set_scales([KV_SCALES[0]], [KV_SCALES[1]])
    return kv, context, layer


def _layer_forward(make_backend, kv, context, layer, new_lens, qkv):
    """One forward through the attention layer (which applies the cache's scales) over requests holding
    PREFIX_LENS cached tokens."""
    rows = fill_prefixes(kv, PREFIX_LENS)
    batch = build_batch(kv, rows, PREFIX_LENS, [[1] * n for n in new_lens], context.device)
    backend = make_backend(context)
    backend.init_forward_metadata(batch)
    q, k, v = (t.to(context.device, context.model_dtype) for t in qkv)
    return PagedAttention(layer)(q, k, v, batch, backend)
