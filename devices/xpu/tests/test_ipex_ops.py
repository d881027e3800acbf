"""IPEX's fused ops (device_shared/ipex_ops.py) against the torch-native references, on the fake IPEX of each build."""

from __future__ import annotations

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
