"""aiter's fused MoE as omnirun's `fused_moe` (devices/rocm/aiter_moe.py), over the fake aiter: the routed mixture
the torch reference computes, in bf16/fp16; what aiter is not called for goes to the fallback it was handed; and the
platform offers it only on request (OMNIRUN_ROCM_AITER_MOE=1), over a graph-safe portable fused_moe."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from omnirun.layers import native_ops


def _inputs(dtype, tokens=7, experts=4, hidden=32, inter=16):
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    logits = torch.randn(tokens, experts, generator=gen)
    logits[:, -1] -= 40.0  # the last expert gets no token
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) / inter**0.5).to(dtype)
    return x, logits, w13, w2


def _op(plain=native_ops.fused_moe):
    import aiter

    from omnirun.devices.rocm.aiter_moe import aiter_fused_moe

    return aiter_fused_moe(aiter, plain, native_ops.route)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("renormalize", [True, False])
def test_the_mixture_equals_the_reference(aiter, dtype, renormalize):
    x, logits, w13, w2 = _inputs(dtype)
    got = _op()(x, logits, w13, w2, 2, renormalize)
    expected = native_ops.fused_moe(x, logits, w13, w2, 2, renormalize)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)
    assert aiter.calls == {"fused_moe": 1}
    # gate and up taken the other way round give another mixture: the test sees the order aiter reads
    swapped = torch.cat(w13.chunk(2, dim=1)[::-1], dim=1)
    assert not torch.allclose(_op()(x, logits, swapped, w2, 2, renormalize).float(), expected.float(), atol=2e-2)


@pytest.mark.parametrize(
    "case",
    ["float32", "weights in another dtype", "one rank's experts", "no tokens"],
)
def test_what_aiter_is_not_called_for_goes_to_the_fallback(aiter, case):
    x, logits, w13, w2 = _inputs(torch.float32 if case == "float32" else torch.bfloat16)
    start = 0
    if case == "weights in another dtype":
        w13, w2 = w13.half(), w2.half()
    elif case == "one rank's experts":
        w13, w2, start = w13[2:], w2[2:], 2
    elif case == "no tokens":
        x = x[:0]
        logits = logits[:0]
    seen = []

    def plain(x, *args):
        seen.append(case)
        return torch.zeros_like(x)

    out = _op(plain)(x, logits, w13, w2, 2, True, start)
    assert out.shape == x.shape and not aiter.calls
    assert seen == ([] if case == "no tokens" else [case])


def _rocm(fake_rocm, triton: bool):
    class Platform(type(fake_rocm)):
        def _capabilities(self):
            return dataclasses.replace(super()._capabilities(), supports_triton=triton)

    return Platform()


@pytest.mark.parametrize("requested", [False, True])
def test_the_platform_offers_it_on_request_over_triton_s_fused_moe(fake_rocm, monkeypatch, requested):
    pytest.importorskip("triton", reason="the portable fused_moe it hands back to is Triton's")
    if requested:
        monkeypatch.setenv("OMNIRUN_ROCM_AITER_MOE", "1")
    else:
        monkeypatch.delenv("OMNIRUN_ROCM_AITER_MOE", raising=False)
    with_triton, without_triton = _rocm(fake_rocm, True), _rocm(fake_rocm, False)
    op = with_triton.fused_ops()["fused_moe"]
    while isinstance(op, functools.partial):  # Triton's op comes bound to its launch table
        op = op.func
    origin = op.__module__
    assert origin.endswith("aiter_moe" if requested else "triton.moe"), origin
    # without Triton the fallback would be the reference, which no decode graph can hold: not offered
    assert "fused_moe" not in without_triton.fused_ops()
    notes = with_triton.notes()
    assert bool(notes) != requested and all("OMNIRUN_ROCM_AITER_MOE=1" in note for note in notes)
