"""IPEX's fused ops (device_shared/ipex_ops.py, and the xpu platform's fused_moe in devices/xpu/ipex_moe.py) against the
torch-native references, on the fake IPEX of each build."""

from __future__ import annotations

import inspect

import pytest
import torch

from omnirun.device_shared.ipex_ops import ipex_fused_ops
from omnirun.layers import native_ops
from omnirun.layers.rotary import cos_sin_table

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("build", ["xpu", "cpu"])
def test_norms_equal_the_references(install_ipex, build, dtype) -> None:
    ipex = install_ipex(build)
    ops = ipex_fused_ops(build, fallback={})
    gen = torch.Generator().manual_seed(0)
    x, residual = (torch.randn(5, 64, generator=gen).to(dtype) for _ in range(2))
    weight = (torch.rand(64, generator=gen) + 0.5).to(dtype)
    tol = TOL[dtype]
    want = native_ops.rms_norm(x, weight, 1e-6)
    torch.testing.assert_close(ops["rms_norm"](x, weight, 1e-6), want, atol=tol, rtol=tol)
    before = residual.clone()
    got, summed = ops["add_rms_norm"](x, residual, weight, 1e-6)
    want, want_sum = native_ops.add_rms_norm(x, residual, weight, 1e-6)
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    torch.testing.assert_close(summed, want_sum)
    assert torch.equal(residual, before), "the caller's residual must stay as it was"
    assert ipex.calls["rms_norm"] == 1 and ipex.calls["add_rms_norm"] == 1
    xpu_only = [] if build == "cpu" else ["rotary_embedding", "silu_and_mul"]
    assert sorted(ops) == ["add_rms_norm", "rms_norm", *xpu_only]


def test_norms_fall_back_where_ipex_would_not_take_them(install_ipex) -> None:
    ipex = install_ipex("cpu")
    seen = []
    fallback = {"rms_norm": lambda *a: seen.append("rms") or native_ops.rms_norm(*a)}
    ops = ipex_fused_ops("cpu", fallback=fallback)
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    ops["rms_norm"](x, torch.ones(8), 1e-6)  # a float32 weight with a bf16 input
    ops["add_rms_norm"](x, torch.randn(3, 8), torch.ones(8, dtype=torch.bfloat16), 1e-6)  # residual dtype differs
    assert seen == ["rms"] and ipex.calls["rms_norm"] == ipex.calls["add_rms_norm"] == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_xpu_silu_and_mul(install_ipex, dtype) -> None:
    ipex = install_ipex("xpu")
    silu = ipex_fused_ops("xpu", fallback={})["silu_and_mul"]
    x = torch.randn(4, 32).to(dtype)
    torch.testing.assert_close(silu(x), native_ops.silu_and_mul(x), atol=TOL[dtype], rtol=TOL[dtype])
    assert ipex.calls["silu_and_mul"] == 1
    silu(torch.randn(4, 8, dtype=torch.float64))  # a dtype IPEX's kernel lacks: the reference
    assert ipex.calls["silu_and_mul"] == 1
    with pytest.raises(TypeError):  # the XPU build's own bug without `out`, which the op never hits
        ipex.llm.functional.silu_and_mul(x)


@pytest.mark.parametrize("head_dim,calls", [(32, 1), (16, 0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_xpu_rotary(install_ipex, dtype, head_dim, calls) -> None:
    ipex = install_ipex("xpu")
    rope = ipex_fused_ops("xpu", fallback={})["rotary_embedding"]
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    table = cos_sin_table(inv_freq, 1.0, 64)
    qkv = torch.randn(6, (4 + 2 + 2) * head_dim).to(dtype)
    q, k, _ = qkv.split([4 * head_dim, 2 * head_dim, 2 * head_dim], dim=-1)  # strided views, as the model has
    positions = torch.tensor([0, 3, 9, 1, 63, 7])
    before = qkv.clone()
    got = rope(positions, q, k, table, head_dim)
    want = native_ops.rotary_embedding(positions, q, k, table, head_dim)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=TOL[dtype] * 2, rtol=TOL[dtype] * 2)
    assert torch.equal(qkv, before), "q and k must stay as they were"
    assert ipex.calls["rotary_embedding_batched"] == calls
    rope(positions, q, k, table, head_dim)  # the table cast is made once per table and dtype
    assert ipex.calls["rotary_embedding_batched"] == 2 * calls


def test_xpu_rope_refuses_what_the_kernel_refuses(install_ipex) -> None:
    ipex = install_ipex("xpu")
    rope = ipex.llm.functional.rotary_embedding_batched
    q, k = torch.randn(2, 64), torch.randn(2, 32)
    with pytest.raises(RuntimeError, match="cos_sin_cache"):
        rope(torch.zeros(2, dtype=torch.int64), q, k, 32, torch.zeros(8, 32, dtype=torch.bfloat16), True, 32)
    with pytest.raises(RuntimeError, match="int64"):
        rope(torch.zeros(2, dtype=torch.int32), q, k, 32, torch.zeros(8, 32), True, 32)


# --- fused_moe over IPEX's GatedMLPMOE (omnirun.devices.xpu.ipex_moe) ---
MOE_TOKENS, MOE_EXPERTS, MOE_HIDDEN, MOE_INTER = 9, 6, 32, 16
MOE_TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 3e-2, "rtol": 2e-2}}
MOE_TOL[torch.float16] = MOE_TOL[torch.bfloat16]


def _moe_inputs(dtype, seed=0):
    """Expert 0 takes every token (each token's first choice, by a margin that leaves the second choice a weight that
    renormalising changes), expert 5 none, expert 3 exactly one (token 4's second choice). The weights are
    parameters, as SparseMoE holds them."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(MOE_TOKENS, MOE_EXPERTS, generator=gen)
    logits[:, 5] = logits[:, 3] = -40.0
    logits[:, 0] = logits.max(dim=1).values + 0.5
    logits[4, 3] = logits[4, 0] - 0.25
    x = torch.randn(MOE_TOKENS, MOE_HIDDEN, generator=gen).to(dtype)
    w13 = (torch.randn(MOE_EXPERTS, 2 * MOE_INTER, MOE_HIDDEN, generator=gen) * 0.2).to(dtype)
    w2 = (torch.randn(MOE_EXPERTS, MOE_HIDDEN, MOE_INTER, generator=gen) * 0.25).to(dtype)
    return x, logits, torch.nn.Parameter(w13, requires_grad=False), torch.nn.Parameter(w2, requires_grad=False)


def _moe_op(fallback=None):
    from omnirun.devices.xpu.ipex_moe import ipex_moe_ops

    return ipex_moe_ops(fallback or {})["fused_moe"]


def _recording_fallback(seen):
    def fused_moe(*args):
        seen.append(args)
        return native_ops.fused_moe(*args)

    return {"fused_moe": fused_moe}


@pytest.mark.parametrize("renormalize", [True, False], ids=["renormalize", "raw-weights"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_xpu_fused_moe_runs_gated_mlp_moe_and_matches_the_reference(install_ipex, dtype, renormalize) -> None:
    """bfloat16 and float16 run IPEX's module; float32, which XeTLA's grouped GEMM refuses on XMX GPUs, the fallback."""
    ipex = install_ipex("xpu")
    seen = []
    fused_moe = _moe_op(_recording_fallback(seen))
    x, logits, w13, w2 = _moe_inputs(dtype)
    routed = native_ops.route(logits, 2, renormalize)[1]
    assert (routed == 0).any(dim=1).all() and not (routed == 5).any() and int((routed == 3).sum()) == 1
    before = w13.clone(), w2.clone()
    with torch.inference_mode():  # as the runner's forward runs it
        got = fused_moe(x, logits, w13, w2, 2, renormalize)
    expected = native_ops.fused_moe(x, logits, w13, w2, 2, renormalize)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    torch.testing.assert_close(got.float(), expected.float(), **MOE_TOL[dtype])
    # The other normalisation is far from it: skipping (or forcing) the renormalisation shows.
    other = native_ops.fused_moe(x, logits, w13, w2, 2, not renormalize)
    assert (other.float() - expected.float()).abs().max() > 0.1
    assert torch.equal(w13, before[0]) and torch.equal(w2, before[1])
    if dtype == torch.float32:
        assert len(seen) == 1 and ipex.calls["GatedMLPMOE"] == ipex.calls["GatedMLPMOE.forward"] == 0
        assert w13.is_contiguous() and w2.is_contiguous()  # untouched
        return
    assert not seen and ipex.calls["GatedMLPMOE"] == 1 and ipex.calls["GatedMLPMOE.forward"] == 1
    # IPEX re-pointed the aliases it was given, not our parameters: same shape and values (above), in the kernel's
    # layout (transposed strides), and still normal tensors (a weight update must be able to write them).
    assert w13.transpose(1, 2).is_contiguous() and w2.transpose(1, 2).is_contiguous()
    assert not w13.is_inference() and not w2.is_inference()
    # Built once per weight pair: a second call reuses the module.
    torch.testing.assert_close(fused_moe(x, logits, w13, w2, 2, renormalize), got)
    assert ipex.calls["GatedMLPMOE"] == 1 and ipex.calls["GatedMLPMOE.forward"] == 2


def test_xpu_fused_moe_follows_weight_updates_into_the_same_tensors(install_ipex) -> None:
    """omnirun's weight updates copy into views of `param.data` (common/weights.py), which torch's version counter does
    not see; the module reads the parameters' own storage, so every update reaches it without a rebuild. A parameter
    given new storage gets a new module."""
    ipex = install_ipex("xpu")
    fused_moe = _moe_op()
    dtype, tol = torch.bfloat16, MOE_TOL[torch.bfloat16]
    x, logits, w13, w2 = _moe_inputs(dtype)
    fused_moe(x, logits, w13, w2, 2, True)
    gen = torch.Generator().manual_seed(7)
    version = w13._version
    with torch.no_grad():  # expert 0's gate rows, as apply_update writes them
        w13.data[0].narrow(0, 0, MOE_INTER).copy_(torch.randn(MOE_INTER, MOE_HIDDEN, generator=gen))
    assert w13._version == version, "a write through .data moves no version counter"
    expected = native_ops.fused_moe(x, logits, w13, w2, 2, True)
    torch.testing.assert_close(fused_moe(x, logits, w13, w2, 2, True).float(), expected.float(), **tol)
    with torch.no_grad():
        w2.mul_(-0.5)  # in place on the parameter itself
    expected = native_ops.fused_moe(x, logits, w13, w2, 2, True)
    torch.testing.assert_close(fused_moe(x, logits, w13, w2, 2, True).float(), expected.float(), **tol)
    assert ipex.calls["GatedMLPMOE"] == 1
    w13.data = (torch.randn(w13.shape, generator=gen) * 0.2).to(dtype)  # new storage, in the checkpoint's layout
    expected = native_ops.fused_moe(x, logits, w13, w2, 2, True)
    torch.testing.assert_close(fused_moe(x, logits, w13, w2, 2, True).float(), expected.float(), **tol)
    assert ipex.calls["GatedMLPMOE"] == 2 and ipex.calls["GatedMLPMOE.forward"] == 4


@pytest.mark.parametrize("version", ["2.8.10+xpu", None], ids=["v2.8-no-offset", "with-experts_start_id"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_xpu_fused_moe_expert_parallel_slices_add_up_to_the_whole(install_ipex, dtype, version) -> None:
    """Two ranks of three experts each: each slice is the reference's slice, and the two sum to all experts. IPEX
    2.8.10 has no expert offset (the fallback runs them); a build whose GatedMLPMOE takes experts_start_id runs them."""
    ipex = install_ipex("xpu", version)
    seen = []
    fused_moe = _moe_op(_recording_fallback(seen))
    x, logits, w13, w2 = _moe_inputs(dtype)
    tol = MOE_TOL[dtype]
    parts = []
    for start in (0, 3):
        a, b = w13[start : start + 3].clone(), w2[start : start + 3].clone()  # one rank's parameters
        expected = native_ops.fused_moe(x, logits, a, b, 2, True, start)
        part = fused_moe(x, logits, a, b, 2, True, start)
        torch.testing.assert_close(part.float(), expected.float(), **tol)
        parts.append(part.float())
    whole = native_ops.fused_moe(x, logits, w13, w2, 2, True)
    torch.testing.assert_close(parts[0] + parts[1], whole.float(), **{k: 2 * v for k, v in tol.items()})
    on_the_kernel = version is None
    assert ipex.calls["GatedMLPMOE.forward"] == (2 if on_the_kernel else 0)
    assert len(seen) == (0 if on_the_kernel else 2)
    # Every expert on one rank needs no offset: either build runs it.
    torch.testing.assert_close(fused_moe(x, logits, w13, w2, 2, True).float(), whole.float(), **tol)
    assert ipex.calls["GatedMLPMOE.forward"] == (3 if on_the_kernel else 1)


def test_xpu_fused_moe_outside_ipex_s_limits_takes_the_fallback(install_ipex) -> None:
    ipex = install_ipex("xpu")
    seen = []
    fused_moe = _moe_op(_recording_fallback(seen))
    x, logits, w13, w2 = _moe_inputs(torch.bfloat16)

    gen = torch.Generator().manual_seed(3)  # (the global generator's state depends on the tests run before)

    def bf16(*shape):
        # Scaled by the fan-in as a model's are: unit weights over H 40 make intermediates of tens, whose bfloat16
        # rounding in the two orders differs past the tolerance.
        return (torch.randn(*shape, generator=gen) / shape[-1] ** 0.5).to(torch.bfloat16)

    cases = {
        "float32 (XeTLA's GEMM: half and bfloat16)": (x.float(), logits, w13.float(), w2.float(), 2),
        "float64": (x.double(), logits, w13.double(), w2.double(), 2),
        "weights in another dtype": (x, logits, w13.float(), w2.float(), 2),
        "integer router logits": (x, logits.round().to(torch.int64), w13, w2, 2),
        "top_k 3 (no instantiation)": (x, logits, w13, w2, 3),
        "more than 128 experts": (x[:2], torch.randn(2, 129), bf16(129, 4, 32), bf16(129, 32, 2), 2),
        "H not a multiple of 8 bfloat16": (bf16(3, 36), logits[:3], bf16(6, 8, 36), bf16(6, 36, 4), 2),
        "an empty batch": (x[:0], logits[:0], w13, w2, 2),
        "3-D activations": (x[None], logits[None], w13, w2, 2),
    }
    refused_by_the_reference_too = {"weights in another dtype": RuntimeError, "3-D activations": ValueError}
    for case, (xs, lg, a, b, k) in cases.items():
        if case in refused_by_the_reference_too:
            with pytest.raises(refused_by_the_reference_too[case]):
                fused_moe(xs, lg, a, b, k, True)
            continue
        got = fused_moe(xs, lg, a, b, k, True)
        torch.testing.assert_close(got, native_ops.fused_moe(xs, lg, a, b, k, True), msg=case)
    assert len(seen) == len(cases) and ipex.calls["GatedMLPMOE.forward"] == 0
    # H of 40 is a multiple of 8: there it runs.
    xs, a, b = bf16(3, 40), bf16(6, 8, 40), bf16(6, 40, 4)
    got, expected = fused_moe(xs, logits[:3], a, b, 2, True), native_ops.fused_moe(xs, logits[:3], a, b, 2, True)
    torch.testing.assert_close(got.float(), expected.float(), **MOE_TOL[torch.bfloat16])
    assert ipex.calls["GatedMLPMOE.forward"] == 1 and len(seen) == len(cases)


def test_fake_gated_mlp_moe_refuses_what_ipex_refuses(install_ipex) -> None:
    ipex = install_ipex("xpu", "2.8.10+xpu")
    gated = ipex.llm.modules.GatedMLPMOE
    x, logits, w13, w2 = _moe_inputs(torch.float32)

    def run(xs, lg, top_k, a=w13, b=w2, grouped=False, module=gated):
        return module(a.clone(), b.clone())(xs, grouped, top_k, lg, True)

    with pytest.raises(RuntimeError, match="not support topk"):
        run(x, logits, 3)
    with pytest.raises(RuntimeError, match="up to 128"):
        run(x[:1], torch.randn(1, 129), 2, torch.randn(129, 4, 32), torch.randn(129, 32, 2))
    with pytest.raises(RuntimeError, match="aligned"):
        half = [t.bfloat16() for t in (torch.randn(2, 36), torch.randn(6, 8, 36), torch.randn(6, 36, 4))]
        run(half[0], logits[:2], 2, half[1], half[2])
    with pytest.raises(RuntimeError, match="no experts_start_id"):
        run(x, logits, 2, w13[:3], w2[:3])
    with pytest.raises(RuntimeError, match="softmax top-k"):
        run(x, logits, 2, grouped=True)
    with pytest.raises(RuntimeError, match="fused W13"):
        gated(w13, w2, w13)
    # float32: v2.8.10's fused GEMM (8 or 16 experts) refuses it, its torch.mm loop (other counts) runs it;
    # v2.10.10 takes the fused GEMM for any count.
    eight = torch.randn(MOE_TOKENS, 8)
    with pytest.raises(RuntimeError, match="only support half and bfloat16"):
        run(x, eight, 2, torch.randn(8, 32, MOE_HIDDEN), torch.randn(8, MOE_HIDDEN, 16))
    run(x, logits, 2)
    newer = install_ipex("xpu").llm.modules.GatedMLPMOE
    with pytest.raises(RuntimeError, match="only support half and bfloat16"):
        run(x, logits, 2, module=newer)
    # Its first forward re-points the tensors it was given at its transposed copies: never hand it a parameter.
    given = w13.clone()
    gated(given, w2.clone())(x, False, 2, logits, True)
    assert given.shape == (MOE_EXPERTS, MOE_HIDDEN, 2 * MOE_INTER)
    assert "experts_start_id" not in inspect.signature(gated).parameters
    assert "experts_start_id" in inspect.signature(newer).parameters
    from omnirun.devices.xpu.ipex_moe import takes_expert_offset

    assert takes_expert_offset(newer) and not takes_expert_offset(gated)
    assert not takes_expert_offset(dict)  # a callable without a signature: no offset assumed


def test_fake_gated_mlp_moe_reads_the_counts_on_the_host(install_ipex) -> None:
    """Each forward copies the row counts to the host (rows_for_experts.to("cpu")): a graph capture refuses it, which
    is why the xpu platform offers the op only where torch has no XPU graphs."""
    from omnirun_fakes.device import RecordingGraph, recording_capture

    install_ipex("xpu")
    fused_moe = _moe_op()
    x, logits, w13, w2 = _moe_inputs(torch.bfloat16)
    fused_moe(x, logits, w13, w2, 2, True)  # eager: built and run
    with pytest.raises(RuntimeError, match="reads a device value on the host"):
        with recording_capture(RecordingGraph()):
            fused_moe(x, logits, w13, w2, 2, True)


def test_xpu_platform_offers_fused_moe_only_without_xpu_graphs(monkeypatch, fake_xpu, install_ipex) -> None:
    from omnirun.assembly import assemble
    from omnirun.config import RunnerConfig
    from omnirun.devices.xpu.platform import XpuPlatform

    monkeypatch.setattr("omnirun.devices.xpu.platform._intel_triton_installed", lambda: False)
    ipex = install_ipex("xpu")
    # This torch has XPUGraph (2.11 on): a MoE model would capture graphs around a host read. Not offered.
    assert XpuPlatform().graph_api() is not None
    assert "fused_moe" not in XpuPlatform().device_fused_ops()
    for name in ("XPUGraph", "graph", "graph_pool_handle"):
        monkeypatch.delattr(torch.xpu, name, raising=False)
    platform = XpuPlatform()
    ops = platform.device_fused_ops()
    quantized = [
        "fp8_linear",
        "int4_linear",
        "prepare_fp8_linear",
        "prepare_int4_linear",
        "fp8_linear_takes",
        "int4_linear_takes",
    ]
    assert sorted(ops) == sorted(
        ["add_rms_norm", *quantized, "fused_moe", "rms_norm", "rotary_embedding", "silu_and_mul"]
    )
    plan = assemble(RunnerConfig(model="stand-in"), platform, torch.bfloat16, 8, 64, experts=True)
    assert plan.graphs is None and plan.graphs_reason == "xpu has no graph API"
    x, logits, w13, w2 = _moe_inputs(torch.bfloat16)
    got = platform.fused_ops()["fused_moe"](x, logits, w13, w2, 2, True)
    torch.testing.assert_close(
        got.float(), native_ops.fused_moe(x, logits, w13, w2, 2, True).float(), **MOE_TOL[torch.bfloat16]
    )
    assert ipex.calls["GatedMLPMOE.forward"] == 1
    del ipex.llm.modules.GatedMLPMOE  # an IPEX without the module
    assert "fused_moe" not in XpuPlatform().device_fused_ops()
