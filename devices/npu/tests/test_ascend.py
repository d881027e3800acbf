"""The ascend backend, NPU graphs and torch_npu fused ops against the references, over the fake torch_npu.

They run in every lane: the fake computes with torch on CPU tensors (it registers torch.ops.atb once per process).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from omnirun.attention.backend import AttentionContext, AttentionLayerSpec
from omnirun.attention.torch_native import TorchNativeAttention
from omnirun.batch import build_batch
from omnirun.errors import ConfigError
from omnirun.layers import native_ops
from omnirun.memory import KVMemory, PageAllocator, PagedKVCache, ReqToTokenPool
from omnirun.testing import fill_prefixes

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import fake_torch_npu as fake  # noqa: E402

CONTEXT_LEN, HEAD_DIM, PREFIX_LENS = 96, 32, [0, 9, 40, 70]
DTYPE = torch.bfloat16


def _lane():
    spec = importlib.util.spec_from_file_location("omnirun_npu_fake_lane", HERE / "fake_lane.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def fake_npu(torch_npu):
    return _lane().FakeNpuPlatform()


def _setup(page_size, heads, kv_heads, window=None, kv_dtype=DTYPE, model_dtype=DTYPE):
    torch.manual_seed(3)
    num_pages = 600 // page_size
    slots = (num_pages + 1) * page_size
    cache = PagedKVCache(1, slots, kv_heads, HEAD_DIM, kv_dtype, "cpu", page_size)
    for buf in cache.k_buffers + cache.v_buffers:
        buf[page_size:] = torch.randn(slots - page_size, kv_heads, HEAD_DIM).to(kv_dtype)
    kv = KVMemory(PageAllocator(num_pages, page_size), ReqToTokenPool(6, CONTEXT_LEN, "cpu"), cache, page_size)
    context = AttentionContext(kv, torch.device("cpu"), model_dtype, heads, kv_heads, HEAD_DIM, CONTEXT_LEN)
    return kv, context, AttentionLayerSpec(0, heads, kv_heads, HEAD_DIM, HEAD_DIM**-0.5, window)


def _forward(make, shape, new_lens):
    kv, context, layer = _setup(*shape)
    rows = fill_prefixes(kv, PREFIX_LENS)
    gen = torch.Generator().manual_seed(7)
    q, k, v = (
        torch.randn(sum(new_lens), n * HEAD_DIM, generator=gen).to(DTYPE) for n in (shape[1], shape[2], shape[2])
    )
    batch = build_batch(kv, rows, PREFIX_LENS, [[1] * n for n in new_lens], context.device)
    backend = make(context)
    backend.init_forward_metadata(batch)
    return backend.forward(q, k, v, layer, batch), kv


SHAPES = [(1, 4, 4), (16, 8, 2), (16, 8, 1, 24), (1, 4, 2, 9)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(map(str, s)))
@pytest.mark.parametrize("new_lens", [[1, 1, 1, 1], [5, 1, 17, 9]], ids=["decode", "extend"])
def test_ascend_equals_torch_native(torch_npu, shape, new_lens):
    from omnirun.devices.npu.ascend_attention import AscendAttention

    got, kv_got = _forward(AscendAttention, shape, new_lens)
    expected, kv_expected = _forward(TorchNativeAttention, shape, new_lens)
    torch.testing.assert_close(got.float(), expected.float(), atol=3e-2, rtol=3e-2)
    assert torch.equal(kv_got.kv_cache.k_buffers[0], kv_expected.kv_cache.k_buffers[0])  # the same slots written


def test_refuses_float32_and_other_kv_dtypes(torch_npu):
    from omnirun.devices.npu.ascend_attention import AscendAttention

    with pytest.raises(ConfigError, match="pass --dtype bfloat16"):
        AscendAttention(_setup(1, 4, 4, model_dtype=torch.float32, kv_dtype=torch.float32)[1])
    with pytest.raises(ConfigError, match="pass --kv-cache-dtype auto"):
        AscendAttention(_setup(1, 4, 4, kv_dtype=torch.float16)[1])


def test_a_cache_in_the_wrong_layout_fails_in_the_fake(torch_npu):
    query = torch.randn(2, 4, HEAD_DIM).to(DTYPE)
    cache = torch.randn(8, 4, 16, HEAD_DIM).to(DTYPE).transpose(1, 2)  # [blocks, 16, heads, D] but HND in memory
    table = torch.zeros(2, 4, dtype=torch.int32)
    with pytest.raises(fake.AtbCheckError, match="contiguous"):
        torch_npu._npu_paged_attention(
            query, cache, cache, 4, 4, 1.0, table, torch.tensor([3, 5], dtype=torch.int32), torch.empty_like(query)
        )
    with pytest.raises(fake.AtbCheckError, match="int32"):
        torch_npu._npu_paged_attention(
            query,
            cache.contiguous(),
            cache.contiguous(),
            4,
            4,
            1.0,
            table.long(),
            torch.tensor([3, 5]),
            torch.empty_like(query),
        )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fused_ops_match_the_references(torch_npu, dtype):
    from omnirun.devices.npu.ascend_ops import ascend_fused_ops

    ops = ascend_fused_ops(torch_npu)
    assert set(ops) == {"rms_norm", "add_rms_norm", "silu_and_mul", "rotary_embedding", "sample", "fused_moe"}
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 2e-2}
    x, r, w = torch.randn(5, 64).to(dtype), torch.randn(5, 64).to(dtype), torch.randn(64).to(dtype)
    torch.testing.assert_close(ops["rms_norm"](x, w, 1e-6), native_ops.rms_norm(x, w, 1e-6), **tol)
    for g, e in zip(ops["add_rms_norm"](x, r, w, 1e-6), native_ops.add_rms_norm(x, r, w, 1e-6), strict=True):
        torch.testing.assert_close(g, e, **tol)
    torch.testing.assert_close(ops["silu_and_mul"](x), native_ops.silu_and_mul(x), **tol)
    table, pos = torch.randn(64, 32), torch.tensor([0, 3, 9, 17, 63])
    q, k = torch.randn(5, 4 * 32).to(dtype), torch.randn(5, 2 * 32).to(dtype)
    for g, e in zip(
        ops["rotary_embedding"](pos, q, k, table, 32), native_ops.rotary_embedding(pos, q, k, table, 32), strict=True
    ):
        torch.testing.assert_close(g, e, **tol)
    # Outside the kernels' constraints (a weight of another dtype, an odd head size): the references.
    w16 = w.to(torch.float16 if dtype == torch.bfloat16 else torch.bfloat16)
    torch.testing.assert_close(ops["rms_norm"](x, w16, 1e-6), native_ops.rms_norm(x, w16, 1e-6))
    for g, e in zip(ops["add_rms_norm"](x, r, w16, 1e-6), native_ops.add_rms_norm(x, r, w16, 1e-6), strict=True):
        torch.testing.assert_close(g, e)
    q64 = torch.randn(5, 4 * 32, dtype=torch.float64)  # no kernel for float64
    for g, e in zip(
        ops["rotary_embedding"](pos, q64, q64, table, 32),
        native_ops.rotary_embedding(pos, q64, q64, table, 32),
        strict=True,
    ):
        torch.testing.assert_close(g, e)
    torch.testing.assert_close(ops["silu_and_mul"](q64), native_ops.silu_and_mul(q64))


# --- fused_moe over torch_npu's MoE kernels (omnirun.devices.npu.ascend_moe) ---
MOE_TOKENS, MOE_EXPERTS, MOE_HIDDEN, MOE_INTER = 9, 6, 32, 16


def _moe_inputs(dtype, seed=0):
    """Expert 0 takes every token (each token's first choice, by a margin that leaves the second choice a weight that
    renormalising changes), expert 5 none, expert 3 exactly one (token 4's second choice)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(MOE_TOKENS, MOE_EXPERTS, generator=gen)
    logits[:, 5] = logits[:, 3] = -40.0
    logits[:, 0] = logits.max(dim=1).values + 0.5
    logits[4, 3] = logits[4, 0] - 0.25
    x = torch.randn(MOE_TOKENS, MOE_HIDDEN, generator=gen).to(dtype)
    w13 = (torch.randn(MOE_EXPERTS, 2 * MOE_INTER, MOE_HIDDEN, generator=gen) * 0.2).to(dtype)
    w2 = (torch.randn(MOE_EXPERTS, MOE_HIDDEN, MOE_INTER, generator=gen) * 0.25).to(dtype)
    return x, logits, w13, w2


def _moe_tolerance(dtype):
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 2e-2}


def _count_moe_calls(torch_npu, monkeypatch):
    """Wrap every kernel the op calls; returns the calls per kernel name."""
    from omnirun.devices.npu.ascend_moe import MOE_KERNELS

    calls = dict.fromkeys(MOE_KERNELS, 0)

    def counted(name, kernel):
        def call(*args, **kwargs):
            calls[name] += 1
            return kernel(*args, **kwargs)

        return call

    for name in MOE_KERNELS:
        monkeypatch.setattr(torch_npu, name, counted(name, getattr(torch_npu, name)))
    return calls


@pytest.mark.parametrize("renormalize", [True, False], ids=["renormalize", "raw-weights"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_runs_the_kernels_and_matches_the_reference(torch_npu, monkeypatch, dtype, renormalize):
    from omnirun.devices.npu.ascend_ops import ascend_fused_ops

    calls = _count_moe_calls(torch_npu, monkeypatch)
    fused_moe = ascend_fused_ops(torch_npu)["fused_moe"]
    x, logits, w13, w2 = _moe_inputs(dtype)
    routed = native_ops.route(logits, 2, renormalize)[1]
    assert (routed == 0).any(dim=1).all() and not (routed == 5).any() and int((routed == 3).sum()) == 1
    got = fused_moe(x, logits, w13, w2, 2, renormalize)
    expected = native_ops.fused_moe(x, logits, w13, w2, 2, renormalize)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    torch.testing.assert_close(got.float(), expected.float(), **_moe_tolerance(dtype))
    # The other normalisation is far from it: skipping (or forcing) the renormalisation shows.
    other = native_ops.fused_moe(x, logits, w13, w2, 2, not renormalize)
    assert (other.float() - expected.float()).abs().max() > 0.1
    assert calls == {
        "npu_moe_gating_top_k_softmax": 1,
        "npu_moe_init_routing": 1,
        "npu_moe_compute_expert_tokens": 1,
        "npu_grouped_matmul": 2,
        "npu_swiglu": 1,
        "npu_moe_finalize_routing": 1,
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_expert_parallel_slices_add_up_to_the_whole(torch_npu, monkeypatch, dtype):
    """Two ranks of three experts each: each slice is the reference's slice, and the two sum to all experts. Other
    ranks' slots run through local expert 0 and are zeroed: with that expert's weights at inf, every token it does
    not serve still gets the reference's (finite) output."""
    from omnirun.devices.npu.ascend_ops import ascend_fused_ops

    calls = _count_moe_calls(torch_npu, monkeypatch)
    fused_moe = ascend_fused_ops(torch_npu)["fused_moe"]
    x, logits, w13, w2 = _moe_inputs(dtype)
    tol = _moe_tolerance(dtype)
    parts = []
    for start in (0, 3):
        part = fused_moe(x, logits, w13[start : start + 3], w2[start : start + 3], 2, True, start)
        expected = native_ops.fused_moe(x, logits, w13[start : start + 3], w2[start : start + 3], 2, True, start)
        torch.testing.assert_close(part.float(), expected.float(), **tol)
        parts.append(part.float())
    whole = native_ops.fused_moe(x, logits, w13, w2, 2, True)
    torch.testing.assert_close(parts[0] + parts[1], whole.float(), **{k: 2 * v for k, v in tol.items()})
    assert calls["npu_moe_init_routing"] == 2 and calls["npu_grouped_matmul"] == 4

    broken = w2[3:6].clone()
    broken[0] = float("inf")  # global expert 3: token 4 only
    got = fused_moe(x, logits, w13[3:6], broken, 2, True, 3)
    expected = native_ops.fused_moe(x, logits, w13[3:6], broken, 2, True, 3)
    others = torch.arange(MOE_TOKENS) != 4
    assert torch.isfinite(got[others]).all()
    torch.testing.assert_close(got[others].float(), expected[others].float(), **tol)


def test_fused_moe_outside_the_kernels_constraints_takes_the_reference(torch_npu, monkeypatch):
    from omnirun.devices.npu.ascend_ops import ascend_fused_ops

    calls = _count_moe_calls(torch_npu, monkeypatch)
    fused_moe = ascend_fused_ops(torch_npu)["fused_moe"]
    x, logits, w13, w2 = _moe_inputs(torch.float32)
    cases = {
        "float64 (no kernel)": (x.double(), logits, w13.double(), w2.double(), 2),
        "more than 1024 local experts": (
            x[:2],
            torch.randn(2, 1025),
            torch.randn(1025, 4, 32),
            torch.randn(1025, 32, 2),
            2,
        ),
        "non-contiguous weights": (x, logits, w13.transpose(1, 2).contiguous().transpose(1, 2), w2, 2),
        "an empty batch": (x[:0], logits[:0], w13, w2, 2),
        "top_k above the experts": (x, logits[:, :1], w13[:1], w2[:1], 2),
    }
    for case, (xs, lg, a, b, k) in cases.items():
        if case == "top_k above the experts":
            with pytest.raises(RuntimeError):  # the reference's torch.topk refuses it too
                fused_moe(xs, lg, a, b, k, True)
            continue
        got = fused_moe(xs, lg, a, b, k, True)
        torch.testing.assert_close(got, native_ops.fused_moe(xs, lg, a, b, k, True), msg=case)
    assert sum(calls.values()) == 0


def test_fused_moe_cuts_long_batches_for_init_routing_s_size_limit(torch_npu, monkeypatch):
    """npu_moe_init_routing takes x below 2^24 elements: a longer batch goes in several calls (here a limit of
    three tokens' worth), and the parts are the reference's rows."""
    from omnirun.devices.npu import ascend_moe
    from omnirun.devices.npu.ascend_ops import ascend_fused_ops

    monkeypatch.setattr(ascend_moe, "ROUTING_SIZE_LIMIT", 3 * MOE_HIDDEN + 1)
    calls = _count_moe_calls(torch_npu, monkeypatch)
    fused_moe = ascend_fused_ops(torch_npu)["fused_moe"]
    x, logits, w13, w2 = _moe_inputs(torch.float32)
    got = fused_moe(x, logits, w13, w2, 2, True)
    torch.testing.assert_close(got, native_ops.fused_moe(x, logits, w13, w2, 2, True), atol=1e-5, rtol=1e-5)
    assert calls["npu_moe_init_routing"] == MOE_TOKENS // 3 and calls["npu_moe_finalize_routing"] == MOE_TOKENS // 3


@pytest.mark.parametrize("expert_start", [0, 3], ids=["all-experts", "expert-parallel"])
def test_fused_moe_is_captured_and_replayed_in_an_npu_graph(torch_npu, expert_start):
    """No host read anywhere (the recording graph refuses one): captured once, replayed on new tokens and logits."""
    from omnirun.devices.npu.ascend_ops import ascend_fused_ops
    from omnirun.devices.npu.npu_graphs import npu_graph_api

    fused_moe = ascend_fused_ops(torch_npu)["fused_moe"]
    x, logits, w13, w2 = _moe_inputs(torch.bfloat16)
    n = MOE_EXPERTS - expert_start
    w13, w2 = w13[expert_start:], w2[expert_start:]
    api = npu_graph_api(torch_npu)
    graph = api.new_graph()
    with torch.inference_mode(), api.capture(graph, pool=api.new_pool()):
        out = fused_moe(x, logits, w13, w2, 2, True, expert_start)
    new_x, new_logits, _, _ = _moe_inputs(torch.bfloat16, seed=1)
    x.copy_(new_x)
    logits.copy_(new_logits.roll(1, dims=1))  # other experts than at capture
    with torch.inference_mode():
        graph.replay()
    expected = native_ops.fused_moe(x, logits, w13, w2, 2, True, expert_start)
    assert n == w13.shape[0]
    torch.testing.assert_close(out.float(), expected.float(), atol=3e-2, rtol=2e-2)


def test_the_fake_moe_kernels_check_their_documented_constraints(torch_npu):
    """The fake refuses what the docs rule out, so that the op's calls are checked against them."""
    x, logits, w13, _ = _moe_inputs(torch.float32)
    with pytest.raises(fake.AtbCheckError, match="k in"):
        torch_npu.npu_moe_gating_top_k_softmax(logits, None, k=MOE_EXPERTS + 1)
    weights, ids, row_idx = torch_npu.npu_moe_gating_top_k_softmax(logits, None, k=2)
    with pytest.raises(fake.AtbCheckError, match="int32"):
        torch_npu.npu_moe_init_routing(x, row_idx=row_idx, expert_idx=ids.long(), active_num=MOE_TOKENS)
    with pytest.raises(fake.AtbCheckError, match="each slot once"):
        torch_npu.npu_moe_init_routing(x, row_idx=torch.zeros_like(row_idx), expert_idx=ids, active_num=MOE_TOKENS)
    expanded_x, _, sorted_ids = torch_npu.npu_moe_init_routing(x, row_idx=row_idx, expert_idx=ids, active_num=2)
    assert expanded_x.shape == (2 * 2, MOE_HIDDEN)  # min(NUM_ROWS, active_num) * K rows
    with pytest.raises(fake.AtbCheckError, match="num_expert"):
        torch_npu.npu_moe_compute_expert_tokens(sorted_ids, 2)  # ids up to 4 with two experts
    with pytest.raises(fake.AtbCheckError, match="sorted"):
        torch_npu.npu_moe_compute_expert_tokens(sorted_ids.flip(0), MOE_EXPERTS)
    counts = torch_npu.npu_moe_compute_expert_tokens(sorted_ids, MOE_EXPERTS)
    assert counts.tolist() == [int((sorted_ids <= e).sum()) for e in range(MOE_EXPERTS)]
    rows = torch.randn(2 * MOE_TOKENS, MOE_HIDDEN)
    weight = w13.transpose(1, 2)
    gmm = torch_npu.npu_grouped_matmul
    with pytest.raises(fake.AtbCheckError, match="cover"):  # the last cumulative count must be the row count
        gmm(x=[rows], weight=[weight], split_item=2, group_type=0, group_list=counts.long() - 1)
    with pytest.raises(fake.AtbCheckError, match="transposed"):
        gmm(x=[rows], weight=[weight.transpose(0, 1)], split_item=2, group_type=0, group_list=counts.long())
    with pytest.raises(fake.AtbCheckError, match="group_type 0"):
        gmm(x=[rows], weight=[weight], group_list=counts.long())
    sizes = torch.diff(counts.long(), prepend=counts.new_zeros(1).long())
    by_size = gmm(x=[rows], weight=[weight], split_item=2, group_type=0, group_list=sizes, group_list_type=1)[0]
    by_cumsum = gmm(x=[rows], weight=[weight], split_item=2, group_type=0, group_list=counts.long())[0]
    assert torch.equal(by_size, by_cumsum)


def test_the_fake_finalize_routing_follows_its_doc_s_loop(torch_npu):
    """skip1 + skip2 + sum_k scales[i, k] * (rows[src_to_dst[k * N + i]] + bias[expert[i, k]]), as the doc's numpy
    loop computes it."""
    gen = torch.Generator().manual_seed(5)
    n, k, h, e = 5, 3, 8, 4
    rows, skip1, skip2 = (torch.randn(shape, generator=gen) for shape in ((n * k, h), (n, h), (n, h)))
    bias, scales = torch.randn(e, h, generator=gen), torch.randn(n, k, generator=gen)
    src_to_dst = torch.randperm(n * k, generator=gen).to(torch.int32)
    experts = torch.randint(0, e, (n, k), generator=gen, dtype=torch.int32)
    got = torch_npu.npu_moe_finalize_routing(rows, skip1, skip2, bias, scales, src_to_dst, experts)
    expected = skip1 + skip2
    for i in range(n):
        for j in range(k):
            expected[i] += scales[i, j] * (rows[src_to_dst[j * n + i]] + bias[experts[i, j]])
    torch.testing.assert_close(got, expected)
    with pytest.raises(fake.AtbCheckError, match="skip2 only with skip1"):
        torch_npu.npu_moe_finalize_routing(rows, None, skip2, None, scales, src_to_dst, experts)
    with pytest.raises(fake.AtbCheckError, match="rows' dtype"):
        torch_npu.npu_moe_finalize_routing(rows, None, None, None, scales.double(), src_to_dst, experts)


def _sampling_batch(rows: int, vocab: int, every_top_k: bool):
    from omnirun.sampling import SamplingBatch, SamplingParams

    gen = torch.Generator().manual_seed(rows)
    logits = (torch.randn(rows, vocab, generator=gen) * 4).round() / 2  # halves: ties at the cuts
    filters = [
        dict(temperature=0.7, top_k=1024, top_p=0.9),
        dict(top_k=5),
        dict(temperature=1.3, top_k=200, top_p=0.6),
        dict(temperature=0.9, top_k=50, top_p=0.95, min_p=0.1),
        dict(temperature=0.0),  # greedy: its k (the vocabulary) is out of the op's range
        dict(temperature=2.0, top_k=900, top_p=0.3),
        dict(temperature=0.5, top_k=3, top_p=0.5),
        dict(temperature=1.0, top_k=1),
    ]
    params = [SamplingParams(**filters[i % len(filters)], seed=i) for i in range(rows)]
    if not every_top_k:
        params[1] = SamplingParams(temperature=0.8, top_p=0.9, seed=1)
    return logits, SamplingBatch.build(params, list(range(rows)), "cpu", vocab_size=vocab)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sample_filters_with_npu_top_k_top_p_and_draws_the_reference_s_tokens(torch_npu, monkeypatch, dtype):
    """Seeded rows with top-k and top-p over logits with ties at the cuts: the op's filter (the CANN doc's formula,
    in the fake) and the reference's keep the same tokens, so every sampled row draws the reference's token."""
    from omnirun.devices.npu.ascend_ops import ascend_fused_ops
    from omnirun.sampling import reference

    calls = []
    monkeypatch.setattr(torch_npu, "npu_top_k_top_p", lambda *a: calls.append(a) or fake.npu_top_k_top_p(*a))
    sample = ascend_fused_ops(torch_npu)["sample"]
    for every_top_k, filtered_by_the_op in ((True, 1), (False, 0)):  # a row without top-k: all by the reference
        calls.clear()
        logits, batch = _sampling_batch(96, 3_000, every_top_k)
        logits = logits.to(dtype)
        got, expected = sample(logits, batch), reference.sample(logits, batch)
        sampled = ~batch.greedy
        assert torch.equal(got[sampled], expected[sampled])
        assert len(calls) == filtered_by_the_op


def test_platform_offers_ascend_graphs_and_ops(fake_npu):
    assert fake_npu.attention_backends() == ("ascend", "torch_native")
    assert fake_npu.default_attention_backend_for("decode", torch.bfloat16) == "ascend"
    assert fake_npu.default_attention_backend_for("decode", torch.float32) == "torch_native"
    best = fake_npu.capabilities.model_dtypes[0]  # the deprecated dtype-blind default: the best dtype's
    assert fake_npu.default_attention_backend("prefill") == fake_npu.default_attention_backend_for("prefill", best)
    assert fake_npu.graph_api().name == "npu_graph"
    assert set(fake_npu.fused_ops()) == {
        "rms_norm",
        "add_rms_norm",
        "silu_and_mul",
        "rotary_embedding",
        "sample",
        "fused_moe",
        "int4_linear",  # Atlas A2 runs int4pack weights (test_ascend_quant.py); fp8_linear is never offered
        "prepare_int4_linear",
        "int4_linear_takes",
        "int4_fused_moe",  # and int4 experts on npu_grouped_matmul (test_ascend_moe_int4.py)
        "prepare_int4_fused_moe",
    }
    assert "ascend attention and NPU graphs" in fake_npu.notes()[0]
    assert fake_npu.notes()[1].startswith("int4 layers run npu_weight_quant_batchmatmul")
    assert fake_npu.notes()[2].startswith("int4 experts run npu_grouped_matmul's antiquant mode")


def test_without_nnal_no_ascend_and_no_graphs(fake_npu, monkeypatch):
    monkeypatch.setattr("omnirun.devices.npu.platform.atb_op_registered", lambda name: False)
    assert fake_npu.attention_backends() == ("torch_native",)
    assert fake_npu.graph_api() is None
    assert fake_npu.default_attention_backend_for("decode", torch.bfloat16) == "torch_native"
    assert "NNAL" in fake_npu.notes()[0]


def test_without_torch_npu_nothing_vendor(monkeypatch):
    from omnirun.devices.npu.platform import NpuPlatform

    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, p=None: None if n == "torch_npu" else real(n, p))
    platform = _lane().FakeNpuPlatform()
    assert platform.attention_offers() == () and platform.graph_api() is None
    assert platform.device_fused_ops() == {}
    assert NpuPlatform().notes() == ()  # unavailable: the probe's reason says why


def test_graph_replay_rewrites_the_host_lengths(torch_npu):
    """Capture one decode step, then replay it for longer contexts: only NPUGraph.update carries the new lengths."""
    from omnirun.devices.npu.ascend_attention import AscendAttention
    from omnirun.devices.npu.npu_graphs import npu_graph_api

    kv, context, layer = _setup(16, 8, 2)
    rows = fill_prefixes(kv, [9, 30])
    backend = AscendAttention(context)
    backend.init_graph_state(2)
    api = npu_graph_api(torch_npu)
    q = torch.randn(2, 8 * HEAD_DIM).to(DTYPE)
    k = torch.randn(2, 2 * HEAD_DIM).to(DTYPE)
    batch = captured = build_batch(kv, rows, [9, 30], [[1], [1]], context.device)
    backend.init_forward_metadata_capture(batch)
    graph = api.new_graph()
    with torch.inference_mode(), api.capture(graph, pool=api.new_pool()):
        out = backend.forward(q, k, k, layer, batch)
    assert set(graph.host_inputs) == {"context_lens"}
    batch = build_batch(kv, rows, [10, 31], [[1], [1]], context.device)
    backend.init_forward_metadata_replay(batch, 2)
    captured.out_cache_loc.copy_(batch.out_cache_loc)  # the static input the graph runner rewrites
    with torch.inference_mode():
        graph.replay()
    assert graph.graph.updates == 1
    eager = TorchNativeAttention(context)
    eager.init_forward_metadata(batch)
    torch.testing.assert_close(out.float(), eager.forward(q, k, k, layer, batch).float(), atol=3e-2, rtol=3e-2)
    graph.reset()
    assert not graph.host_inputs and graph.pool() is not None
