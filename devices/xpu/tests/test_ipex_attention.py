"""The ipex attention backend (device_shared/ipex_attention.py) against torch_native, on the fake IPEX of each build:
decode and extend over a cached prefix, page sizes 1 and 16, GQA, a sliding window, fp8 caches, graphs."""

from __future__ import annotations

import pytest
import torch

from omnirun.attention.backend import AttentionContext, AttentionLayerSpec
from omnirun.attention.torch_native import TorchNativeAttention
from omnirun.batch import ForwardBatch, ForwardMode, build_batch
from omnirun.device_shared.ipex_attention import IpexAttention, graph_capturable
from omnirun.errors import ConfigError
from omnirun.memory import KVMemory, PageAllocator, PagedKVCache, ReqToTokenPool
from omnirun.testing import fill_prefixes
from omnirun_fakes.device import RecordingGraph, recording_capture

CONTEXT_LEN = 96
PREFIX_LENS = [0, 5, 23, 61]
# (page size, query heads, KV heads, sliding window)
SHAPES = [(1, 4, 4, None), (16, 8, 2, None), (16, 6, 2, 12), (1, 8, 1, None)]


def _setup(page_size, heads, kv_heads, head_dim, model_dtype, kv_dtype):
    torch.manual_seed(3)
    num_pages = 480 // page_size
    slots = (num_pages + 1) * page_size
    cache = PagedKVCache(1, slots, kv_heads, head_dim, kv_dtype, "cpu", page_size)
    for buf in cache.k_buffers + cache.v_buffers:
        buf[page_size:] = torch.randn(slots - page_size, kv_heads, head_dim).to(kv_dtype)
    kv = KVMemory(PageAllocator(num_pages, page_size), ReqToTokenPool(6, CONTEXT_LEN, "cpu"), cache, page_size)
    context = AttentionContext(kv, torch.device("cpu"), model_dtype, heads, kv_heads, head_dim, CONTEXT_LEN)
    return kv, context


def _forward(make, shape, new_lens, head_dim=64, model_dtype=torch.bfloat16, kv_dtype=None):
    page_size, heads, kv_heads, window = shape
    kv, context = _setup(page_size, heads, kv_heads, head_dim, model_dtype, kv_dtype or model_dtype)
    layer = AttentionLayerSpec(0, heads, kv_heads, head_dim, 0.8 / head_dim**0.5, window)
    rows = fill_prefixes(kv, PREFIX_LENS)
    gen = torch.Generator().manual_seed(7)
    q, k, v = (
        torch.randn(sum(new_lens), n * head_dim, generator=gen).to(model_dtype) for n in (heads, kv_heads, kv_heads)
    )
    batch = build_batch(kv, rows, PREFIX_LENS, [[1] * n for n in new_lens], torch.device("cpu"))
    backend = make(context)
    backend.init_forward_metadata(batch)
    return backend.forward(q, k, v, layer, batch), kv.kv_cache


def _static_batch(size: int) -> ForwardBatch:
    """The graph runner's capture batch: row 0, one key per request, writing the padding slot 0."""
    zeros, ones = torch.zeros(size, dtype=torch.int64), torch.ones(size, dtype=torch.int32)
    return ForwardBatch(
        mode=ForwardMode.DECODE,
        input_ids=zeros.clone(),
        positions=zeros.clone(),
        req_pool_indices=zeros.clone(),
        seq_lens=ones.clone(),
        out_cache_loc=zeros.clone(),
        seq_lens_cpu=ones.clone(),
        extend_prefix_lens_cpu=torch.zeros(size, dtype=torch.int32),
        extend_seq_lens_cpu=ones.clone(),
    )


MODES = {"extend": [5, 1, 17, 9], "decode": [1, 1, 1, 1]}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"ps{s[0]}-h{s[1]}/{s[2]}-w{s[3]}")
@pytest.mark.parametrize("build", ["xpu", "cpu"])
def test_equals_torch_native(install_ipex, build, shape, mode) -> None:
    ipex = install_ipex(build)
    dtype = torch.bfloat16 if build == "xpu" else torch.float32
    tolerance = 3e-2 if dtype == torch.bfloat16 else 1e-4
    want, want_cache = _forward(TorchNativeAttention, shape, MODES[mode], model_dtype=dtype)
    got, got_cache = _forward(lambda c: IpexAttention(c, build), shape, MODES[mode], model_dtype=dtype)
    torch.testing.assert_close(got.float(), want.float(), atol=tolerance, rtol=tolerance)
    # The new K/V went to the same slots as torch_native's.
    torch.testing.assert_close(got_cache.k_buffers[0], want_cache.k_buffers[0])
    store = "reshape_and_cache_flash" if build == "xpu" else "reshape_and_cache"
    assert ipex.calls[store] == 1
    cpu_decode = build == "cpu" and mode == "decode" and shape[3] is None
    assert ipex.calls["single_query_cached_kv_attention" if cpu_decode else "flash_attn_varlen_func"] == 1


@pytest.mark.parametrize("build", ["xpu", "cpu"])
def test_fp8_caches(install_ipex, build) -> None:
    install_ipex(build)
    dtype = torch.bfloat16
    flavours = (torch.float8_e4m3fn, torch.float8_e5m2) if build == "xpu" else (torch.float8_e5m2,)
    for kv_dtype in flavours:
        want, _ = _forward(TorchNativeAttention, SHAPES[1], MODES["extend"], model_dtype=dtype, kv_dtype=kv_dtype)
        ipex = lambda c: IpexAttention(c, build)  # noqa: E731
        got, _ = _forward(ipex, SHAPES[1], MODES["extend"], model_dtype=dtype, kv_dtype=kv_dtype)
        torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)


def test_refusals_name_the_flag(install_ipex) -> None:
    install_ipex("cpu")
    with pytest.raises(ConfigError, match="--kv-cache-dtype auto, fp8_e5m2"):
        _forward(lambda c: IpexAttention(c, "cpu"), SHAPES[1], MODES["decode"], kv_dtype=torch.float8_e4m3fn)
    install_ipex("xpu")
    with pytest.raises(ConfigError, match="--dtype bfloat16"):
        _forward(lambda c: IpexAttention(c, "xpu"), SHAPES[1], MODES["decode"], model_dtype=torch.float32)
    with pytest.raises(ConfigError, match="do not group"):
        _forward(lambda c: IpexAttention(c, "xpu"), (16, 6, 4, None), MODES["decode"])


def test_head_dim_not_a_multiple_of_64_on_xpu(install_ipex) -> None:
    install_ipex("xpu")
    want, _ = _forward(TorchNativeAttention, SHAPES[1], MODES["decode"], head_dim=16)
    got, _ = _forward(lambda c: IpexAttention(c, "xpu"), SHAPES[1], MODES["decode"], head_dim=16)
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)
    assert not graph_capturable("xpu", 16) and graph_capturable("xpu", 128) and graph_capturable("cpu", 16)


class _MisplacedCache(IpexAttention):
    """An ipex backend that hands IPEX the other build's cache layout."""

    def _caches(self, layer):
        k, v = super()._caches(layer)
        return k.transpose(1, 2), v.transpose(1, 2)


@pytest.mark.parametrize("build", ["xpu", "cpu"])
def test_wrong_layout_fails_in_the_fake(install_ipex, build) -> None:
    install_ipex(build)
    with pytest.raises(RuntimeError, match="contiguous|heads or head dim differ"):
        _forward(lambda c: _MisplacedCache(c, build), SHAPES[1], MODES["extend"])


def test_xpu_decode_kernel_layout_is_refused(install_ipex) -> None:
    ipex = install_ipex("xpu")
    paged = ipex.llm.modules.PagedAttention
    with pytest.raises(RuntimeError, match="head_dim, page_size"):
        paged.single_query_cached_kv_attention(*[None] * 11)
    with pytest.raises(RuntimeError, match="D/x"):
        paged.reshape_and_cache(torch.zeros(1, 1, 8), torch.zeros(1, 1, 8), torch.zeros(2, 4, 1, 8), None, None)


@pytest.mark.parametrize("build,head_dim", [("xpu", 64), ("cpu", 16)])
def test_graph_replay_equals_eager(install_ipex, build, head_dim) -> None:
    """Decode captured once at batch size 4 in a recording graph, replayed for 3 requests (one padding row)."""
    install_ipex(build)
    page_size, heads, kv_heads = 16, 8, 2
    kv, context = _setup(page_size, heads, kv_heads, head_dim, torch.bfloat16, torch.bfloat16)
    layer = AttentionLayerSpec(0, heads, kv_heads, head_dim, head_dim**-0.5, None)
    backend = IpexAttention(context, build)
    assert backend.supports_graph
    backend.init_graph_state(4)
    rows = fill_prefixes(kv, PREFIX_LENS[1:])
    capture_batch = _static_batch(4)
    q = torch.zeros(4, heads * head_dim, dtype=torch.bfloat16)
    k = torch.zeros(4, kv_heads * head_dim, dtype=torch.bfloat16)
    static = (q, k, k.clone(), capture_batch.out_cache_loc)
    backend.init_forward_metadata_capture(capture_batch)
    graph = RecordingGraph()
    with recording_capture(graph):
        out = backend.forward(static[0], static[1], static[2], layer, capture_batch)
    batch = build_batch(kv, rows, PREFIX_LENS[1:], [[1]] * 3, torch.device("cpu"))
    gen = torch.Generator().manual_seed(5)
    new = [torch.randn(3, t.shape[1], generator=gen).to(torch.bfloat16) for t in static[:3]]
    for buf, value in zip(static[:3], new, strict=True):
        buf[:3].copy_(value)
    static[3][:3].copy_(batch.out_cache_loc)
    static[3][3:].zero_()
    backend.init_forward_metadata_replay(batch, 4)
    graph.replay()
    replayed = out[:3].clone()
    eager = IpexAttention(context, build)
    eager.init_forward_metadata(batch)
    torch.testing.assert_close(replayed.float(), eager.forward(*new, layer, batch).float(), atol=2e-2, rtol=2e-2)
    with pytest.raises(ValueError, match="replayed in a graph of"):
        backend.init_forward_metadata_replay(_static_batch(5), 4)


def test_xpu_padding_path_cannot_be_captured(install_ipex) -> None:
    install_ipex("xpu")
    kv, context = _setup(16, 8, 2, 16, torch.bfloat16, torch.bfloat16)
    layer = AttentionLayerSpec(0, 8, 2, 16, 0.25, None)
    backend = IpexAttention(context, "xpu")
    assert not backend.supports_graph
    backend.init_graph_state(2)
    batch = _static_batch(2)
    backend.init_forward_metadata_capture(batch)
    q, k = torch.zeros(2, 128, dtype=torch.bfloat16), torch.zeros(2, 32, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="reads a device value on the host"):
        with recording_capture(RecordingGraph()):
            backend.forward(q, k, k.clone(), layer, batch)
