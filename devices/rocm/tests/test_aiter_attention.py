"""The aiter attention backend against torch_native, over the fake aiter (fake_aiter.py): decode and extend with a
cached prefix, pages of 1 and 16 tokens, GQA, sliding windows, bf16/fp16, fp8 KV in the flavour aiter decodes on the
GPU (e4m3fnuz on gfx942, e4m3fn on gfx950), the graph hooks under a recorded graph, and what it refuses."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from omnirun.attention.backend import AttentionContext, AttentionLayerSpec
from omnirun.attention.torch_native import TorchNativeAttention
from omnirun.batch import ForwardBatch, ForwardMode, build_batch
from omnirun.errors import ConfigError
from omnirun.memory import KVMemory, PageAllocator, PagedKVCache, ReqToTokenPool
from omnirun.testing import fill_prefixes
from omnirun_fakes.device import RecordingGraph, recording_capture

CPU = torch.device("cpu")
CONTEXT_LEN = 300  # two decode partitions of 256 keys
HEAD_DIM = 64
PREFIX_LENS = [0, 9, 61, 270]
# (page size, query heads, KV heads, sliding window)
SHAPES = [(1, 4, 4, None), (16, 8, 2, None), (16, 8, 2, 24), (1, 8, 1, 9)]


def _setup(shape, model_dtype, kv_dtype, rows=6):
    page_size, heads, kv_heads, window = shape
    torch.manual_seed(3)
    num_pages = 1600 // page_size
    slots = (num_pages + 1) * page_size
    cache = PagedKVCache(1, slots, kv_heads, HEAD_DIM, kv_dtype, CPU, page_size)
    for buf in cache.k_buffers + cache.v_buffers:
        buf[page_size:] = torch.randn(slots - page_size, kv_heads, HEAD_DIM).to(kv_dtype)
    kv = KVMemory(PageAllocator(num_pages, page_size), ReqToTokenPool(rows, CONTEXT_LEN, CPU), cache, page_size)
    context = AttentionContext(kv, CPU, model_dtype, heads, kv_heads, HEAD_DIM, max_context_len=CONTEXT_LEN)
    layer = AttentionLayerSpec(0, heads, kv_heads, HEAD_DIM, 0.8 / HEAD_DIM**0.5, window)
    return kv, context, layer


def _qkv(context, tokens, seed=7):
    gen = torch.Generator().manual_seed(seed)
    return tuple(
        torch.randn(tokens, n * HEAD_DIM, generator=gen).to(context.model_dtype)
        for n in (context.num_heads, context.num_kv_heads, context.num_kv_heads)
    )


def _forward(make_backend, shape, model_dtype, kv_dtype, new_lens):
    kv, context, layer = _setup(shape, model_dtype, kv_dtype)
    rows = fill_prefixes(kv, PREFIX_LENS)
    q, k, v = _qkv(context, sum(new_lens))
    batch = build_batch(kv, rows, PREFIX_LENS, [[1] * n for n in new_lens], CPU)
    backend = make_backend(context)
    backend.init_forward_metadata(batch)
    return backend.forward(q, k, v, layer, batch)


def _aiter_backend(context):
    from omnirun.devices.rocm.aiter_attention import AiterAttention

    return AiterAttention(context)


MODES = {"extend": [5, 1, 17, 9], "decode": [1, 1, 1, 1]}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("model_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"ps{s[0]}-h{s[1]}/{s[2]}-w{s[3]}")
def test_aiter_equals_torch_native(aiter, shape, model_dtype, mode):
    expected = _forward(TorchNativeAttention, shape, model_dtype, model_dtype, MODES[mode])
    got = _forward(_aiter_backend, shape, model_dtype, model_dtype, MODES[mode])
    assert got.dtype == model_dtype and got.shape == expected.shape
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)
    kernel = "paged_attention_ragged" if mode == "decode" else "flash_attn_varlen_func"
    assert aiter.calls[kernel] == 1 and sum(aiter.calls.values()) == 1


@pytest.mark.parametrize(("gfx", "fp8"), [("gfx942", torch.float8_e4m3fnuz), ("gfx950", torch.float8_e4m3fn)])
@pytest.mark.parametrize("mode", MODES)
def test_fp8_kv_in_the_flavour_aiter_decodes_on_the_gpu(use_aiter, gfx, fp8, mode):
    aiter = use_aiter(gfx)
    shape = (16, 8, 2, None)
    expected = _forward(TorchNativeAttention, shape, torch.bfloat16, fp8, MODES[mode])
    got = _forward(_aiter_backend, shape, torch.bfloat16, fp8, MODES[mode])
    torch.testing.assert_close(got.float(), expected.float(), atol=3e-2, rtol=3e-2)
    assert sum(aiter.calls.values()) == 1


def test_fp8_of_the_other_encoding_or_e5m2_is_refused_with_the_flag(use_aiter):
    use_aiter("gfx942")  # an MI300: aiter decodes e4m3fnuz
    for kv_dtype in (torch.float8_e4m3fn, torch.float8_e5m2fnuz, torch.float8_e5m2):
        _, context, _ = _setup((1, 4, 4, None), torch.bfloat16, kv_dtype)
        with pytest.raises(ConfigError, match="float8_e4m3fnuz.*--kv-cache-dtype auto or fp8_e4m3"):
            _aiter_backend(context)


def test_fake_decodes_fp8_bytes_only_in_the_gpus_encoding(aiter):
    """The kernel reads fp8 as bytes: an e4m3fn cache on an MI300 would be misread, so the fake refuses it."""
    from fake_aiter import AiterCheckError

    kv, _, _ = _setup((1, 4, 4, None), torch.bfloat16, torch.float8_e4m3fn)
    q = torch.zeros(1, 4, HEAD_DIM, dtype=torch.bfloat16)
    cache = kv.kv_cache.k_buffers[0].view(-1, 1, 4, HEAD_DIM)
    table = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(AiterCheckError, match="decodes torch.float8_e4m3fnuz bytes"):
        aiter.paged_attention_ragged(
            torch.empty_like(q), torch.empty(1 << 16, dtype=torch.uint8), q, cache, cache, 1.0, table,
            table[1:], table[1:], 1, 1, None, "fp8_e4m3", "NHD", 0.0, *[torch.ones(1)] * 2,
        )  # fmt: skip
    with pytest.raises(ValueError, match="Unsupported kv_cache_dtype: fp8_e5m2"):
        aiter.paged_attention_ragged(
            torch.empty_like(q), torch.empty(1 << 16, dtype=torch.uint8), q, cache, cache, 1.0, table,
            table[1:], table[1:], 1, 1, None, "fp8_e5m2", "NHD", 0.0, *[torch.ones(1)] * 2,
        )  # fmt: skip


def _decode_args(kv, layer, batch_size=2, **changes):
    heads, kv_heads = layer.num_heads, layer.num_kv_heads
    k_cache, v_cache = kv.kv_cache.get_kv(0)
    args = dict(
        out=torch.empty(batch_size, heads, HEAD_DIM, dtype=torch.bfloat16),
        workspace_buffer=torch.empty(1 << 20, dtype=torch.uint8),
        query=torch.randn(batch_size, heads, HEAD_DIM).to(torch.bfloat16),
        key_cache=k_cache.view(-1, 1, kv_heads, HEAD_DIM),
        value_cache=v_cache.view(-1, 1, kv_heads, HEAD_DIM),
        scale=layer.scaling,
        kv_indptr=torch.tensor([0, 3, 5], dtype=torch.int32),
        kv_page_indices=torch.arange(1, 6, dtype=torch.int32),
        kv_last_page_lens=torch.ones(batch_size, dtype=torch.int32),
        block_size=1,
        max_num_partitions=1,
        alibi_slopes=None,
        kv_cache_dtype="auto",
        kv_cache_layout="NHD",
        logits_soft_cap=0.0,
        k_scale=torch.ones(1),
        v_scale=torch.ones(1),
    )
    args.update(changes)
    return args


def test_fake_decode_refuses_wrong_layouts_dtypes_and_sizes(aiter):
    from fake_aiter import AiterCheckError

    kv, _, layer = _setup((1, 4, 2, None), torch.bfloat16, torch.bfloat16)
    aiter.paged_attention_ragged(**_decode_args(kv, layer))  # the call the backend makes: accepted
    k_cache, v_cache = kv.kv_cache.get_kv(0)
    wrong = {
        "HND named for an NHD cache": dict(kv_cache_layout="HND"),
        "pages of 16 read with block_size 1": dict(key_cache=k_cache[:1600].view(-1, 16, 2, HEAD_DIM)),
        "HND strides": dict(key_cache=k_cache.view(-1, 2, 1, HEAD_DIM).transpose(1, 2)),
        "int64 table": dict(kv_indptr=torch.tensor([0, 3, 5])),
        "small workspace": dict(workspace_buffer=torch.empty(64, dtype=torch.uint8)),
        "non-packed query": dict(query=torch.randn(2, HEAD_DIM, 4).to(torch.bfloat16).transpose(1, 2)),
        "float64 scale": dict(k_scale=torch.ones(1, dtype=torch.float64)),
        "indptr of another batch": dict(kv_indptr=torch.tensor([0, 5], dtype=torch.int32)),
    }
    for what, change in wrong.items():
        with pytest.raises(AiterCheckError):
            aiter.paged_attention_ragged(**_decode_args(kv, layer, **change))
            pytest.fail(f"the fake accepted {what}")
    with pytest.raises(ValueError, match="Unsupported data type"):
        q = torch.randn(2, 4, HEAD_DIM)
        aiter.paged_attention_ragged(**_decode_args(kv, layer, query=q, out=torch.empty_like(q)))


def test_fake_varlen_refuses_what_the_kernel_refuses(aiter):
    from fake_aiter import AiterCheckError

    q = torch.randn(6, 4, HEAD_DIM).to(torch.bfloat16)
    k = torch.randn(9, 2, HEAD_DIM).to(torch.bfloat16)
    cu_q, cu_k = torch.tensor([0, 2, 6], dtype=torch.int32), torch.tensor([0, 4, 9], dtype=torch.int32)
    out, lse = aiter.flash_attn_varlen_func(q, k, k, cu_q, cu_k, 4, 5, causal=True, return_lse=True)
    assert out.shape == q.shape and lse.shape == (4, 6)
    bad = [
        ((q.float(), k.float(), k.float(), cu_q, cu_k, 4, 5), {}),  # fp32
        ((q, k, k, cu_q.long(), cu_k, 4, 5), {}),  # int64 offsets
        ((q, k, k, cu_q, cu_k, 3, 5), {}),  # a sequence longer than max_seqlen_q
        ((q, k[:, :1].expand(9, 3, HEAD_DIM), k, cu_q, cu_k, 4, 5), {}),  # 4 heads over 3
        ((q, k, k, cu_q, cu_k, 4, 5), {"window_size": (1,)}),
    ]
    for args, kwargs in bad:
        with pytest.raises(AiterCheckError):
            aiter.flash_attn_varlen_func(*args, **kwargs)


def test_a_float32_model_is_refused_with_the_fix(aiter):
    _, context, _ = _setup((1, 4, 4, None), torch.float32, torch.float32)
    with pytest.raises(ConfigError, match="bfloat16 or float16, not float32: pass --dtype bfloat16"):
        _aiter_backend(context)


def test_heads_that_do_not_group_and_layers_of_another_shape_are_refused(aiter):
    _, context, layer = _setup((1, 4, 4, None), torch.bfloat16, torch.bfloat16)
    with pytest.raises(ConfigError, match="6 query heads do not group over 4"):
        _aiter_backend(dataclasses.replace(context, num_heads=6))
    kv, context, layer = _setup((1, 4, 4, None), torch.bfloat16, torch.bfloat16)
    backend = _aiter_backend(context)
    rows = fill_prefixes(kv, [3])
    batch = build_batch(kv, rows, [3], [[1]], CPU)
    backend.init_forward_metadata(batch)
    q, k, v = _qkv(context, 1)
    with pytest.raises(ValueError, match="layer 0 differs"):
        backend.forward(q, k, v, dataclasses.replace(layer, head_dim=32), batch)


def _static_batch(max_bs):
    zeros = torch.zeros(max_bs, dtype=torch.int64)
    return ForwardBatch(
        mode=ForwardMode.DECODE,
        input_ids=zeros.clone(),
        positions=zeros.clone(),
        req_pool_indices=zeros.clone(),
        seq_lens=torch.ones(max_bs, dtype=torch.int32),
        out_cache_loc=zeros.clone(),
        seq_lens_cpu=torch.ones(max_bs, dtype=torch.int32),
        extend_prefix_lens_cpu=torch.zeros(max_bs, dtype=torch.int32),
        extend_seq_lens_cpu=torch.ones(max_bs, dtype=torch.int32),
    )


@pytest.mark.parametrize("shape", [(1, 8, 2, None), (16, 8, 2, 24)], ids=["ps1", "ps16-w24"])
def test_a_recorded_graph_replays_a_padded_batch_as_eager_decode(aiter, shape):
    """The graph hooks as the decode graph runner calls them: capture a batch of 4 (row 0, one key each), then
    replay 3 real requests padded to 4; the windows are learned in the warm-up, before the capture."""
    kv, context, layer = _setup(shape, torch.bfloat16, torch.bfloat16)
    second = dataclasses.replace(layer, layer_id=0, sliding_window=None if shape[3] else 5)
    graph_backend = _aiter_backend(context)
    graph_backend.init_graph_state(8)
    static = _static_batch(4)
    q, k, v = (torch.zeros_like(t) for t in _qkv(context, 4))
    graph_backend.init_forward_metadata_capture(static)
    for _ in range(2):  # warm-up
        graph_backend.forward(q, k, v, layer, static), graph_backend.forward(q, k, v, second, static)
    graph = RecordingGraph()
    with recording_capture(graph):
        outs = graph_backend.forward(q, k, v, layer, static), graph_backend.forward(q, k, v, second, static)
    rows = fill_prefixes(kv, [40, 7, 120])
    batch = build_batch(kv, rows, [40, 7, 120], [[1]] * 3, CPU)
    static.out_cache_loc[:3].copy_(batch.out_cache_loc)
    new_q, new_k, new_v = _qkv(context, 3, seed=11)
    q[:3].copy_(new_q), k[:3].copy_(new_k), v[:3].copy_(new_v)
    graph_backend.init_forward_metadata_replay(batch, 4)
    graph.replay()
    eager = TorchNativeAttention(context)
    eager.init_forward_metadata(batch)
    for out, spec in zip(outs, (layer, second), strict=True):
        expected = eager.forward(new_q, new_k, new_v, spec, batch)
        torch.testing.assert_close(out[:3].float(), expected.float(), atol=2e-2, rtol=2e-2)
    assert aiter.calls["paged_attention_ragged"] == 6  # 4 warm-up and 2 captured calls: the replay ran no Python
    with pytest.raises(ValueError, match="batch of 3 requests replayed in a graph of 2"):
        graph_backend.init_forward_metadata_replay(batch, 2)
    with pytest.raises(ValueError, match="exceeds the graph state's 8"):
        graph_backend.init_forward_metadata_replay(batch, 16)


def test_graph_hooks_need_the_graph_state_first(aiter):
    _, context, _ = _setup((1, 4, 4, None), torch.bfloat16, torch.bfloat16)
    with pytest.raises(RuntimeError, match="call init_graph_state"):
        _aiter_backend(context).init_forward_metadata_capture(_static_batch(2))


def test_eager_decode_scratch_grows_in_powers_of_two(aiter):
    _, context, _ = _setup((1, 4, 4, None), torch.bfloat16, torch.bfloat16)
    backend = _aiter_backend(context)
    workspace, ones = backend._eager_scratch(3)
    assert ones.shape == (3,) and backend._scratch[1].shape == (4,)
    assert backend._eager_scratch(2)[0] is workspace  # reused
    assert backend._scratch[1].shape == (4,)
    backend._eager_scratch(5)
    assert backend._scratch[1].shape == (8,)


def test_token_tables():
    from omnirun.devices.rocm.token_table import token_table, window_starts

    table = torch.arange(40).view(4, 10)
    indptr, indices = token_table(table, torch.tensor([2, 0]), torch.tensor([1, 0]), torch.tensor([4, 2]))
    assert indptr.tolist() == [0, 3, 5] and indices.tolist() == [21, 22, 23, 0, 1]
    assert indptr.dtype == indices.dtype == torch.int32
    assert window_starts(torch.tensor([3, 30]), 8).tolist() == [0, 22]
    assert window_starts(torch.tensor([3, 30]), None).tolist() == [0, 0]
    with pytest.raises(ValueError, match="ends before it starts"):
        token_table(table, torch.tensor([0]), torch.tensor([5]), torch.tensor([4]))
