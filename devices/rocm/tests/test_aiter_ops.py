"""aiter's rms norms as omnirun's fused ops, over the fake aiter: equal to the torch-native references in bf16/fp16,
and everything aiter is not called for (float32, a weight of another dtype) goes to the fallback it was handed."""

from __future__ import annotations

import pytest
import torch

from omnirun.layers import native_ops


def _ops(fallback=None):
    from omnirun.devices.rocm.aiter_ops import aiter_norm_ops

    return aiter_norm_ops(fallback=fallback or {})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(5, 64), (2, 3, 64)])
def test_norms_equal_the_references(aiter, dtype, shape):
    ops = _ops()
    gen = torch.Generator().manual_seed(1)
    x, residual = (torch.randn(*shape, generator=gen).to(dtype) for _ in range(2))
    weight = torch.randn(64, generator=gen).to(dtype)
    tolerance = {"atol": 2e-2, "rtol": 2e-2}
    got = ops["rms_norm"](x, weight, 1e-6)
    assert got.shape == x.shape and got.dtype == dtype
    torch.testing.assert_close(got.float(), native_ops.rms_norm(x, weight, 1e-6).float(), **tolerance)
    normed, summed = ops["add_rms_norm"](x, residual, weight, 1e-6)
    expected_normed, expected_summed = native_ops.add_rms_norm(x.clone(), residual.clone(), weight, 1e-6)
    torch.testing.assert_close(summed.float(), expected_summed.float(), **tolerance)
    torch.testing.assert_close(normed.float(), expected_normed.float(), **tolerance)
    assert (normed.shape, summed.shape) == (x.shape, x.shape)
    assert aiter.calls == {"rms_norm": 1, "rmsnorm2d_fwd_with_add": 1}


def test_what_aiter_is_not_called_for_goes_to_the_fallback(aiter):
    seen = []
    fallback = {
        "rms_norm": lambda *a: seen.append("rms_norm") or native_ops.rms_norm(*a),
        "add_rms_norm": lambda *a: seen.append("add_rms_norm") or native_ops.add_rms_norm(*a),
    }
    ops = _ops(fallback)
    x32, w32 = torch.randn(4, 64), torch.randn(64)
    ops["rms_norm"](x32, w32, 1e-6)  # a float32 model
    ops["rms_norm"](x32.bfloat16(), w32, 1e-6)  # a weight of another dtype
    ops["add_rms_norm"](x32, x32.clone(), w32, 1e-6)
    ops["add_rms_norm"](x32.bfloat16(), x32.half(), w32.bfloat16(), 1e-6)  # a residual of another dtype
    assert seen == ["rms_norm", "rms_norm", "add_rms_norm", "add_rms_norm"]
    assert not aiter.calls
    # Without a portable kernel (no triton) the fallback is the torch-native reference.
    plain = _ops()
    torch.testing.assert_close(plain["rms_norm"](x32, w32, 1e-6), native_ops.rms_norm(x32, w32, 1e-6))


def test_fake_norms_refuse_what_the_kernels_refuse(aiter):
    from fake_aiter import AiterCheckError

    x = torch.randn(4, 64).to(torch.bfloat16)
    w = torch.randn(64).to(torch.bfloat16)
    for args in [(x.t(), w[:4]), (x, w.float()), (x, w[:32]), (x.view(2, 2, 64), w), (x.to(torch.int8), w)]:
        with pytest.raises(AiterCheckError):
            aiter.rms_norm(*args, 1e-6)
    out, residual_out = torch.empty_like(x), torch.empty_like(x)
    aiter.rmsnorm2d_fwd_with_add(out, x, x, residual_out, w, 1e-6)
    torch.testing.assert_close(residual_out, x + x)
    with pytest.raises(AiterCheckError):
        aiter.rmsnorm2d_fwd_with_add(out[:2], x, x, residual_out, w, 1e-6)
    with pytest.raises(AiterCheckError):
        aiter.rmsnorm2d_fwd_with_add(out, x, x, residual_out, w, 1e-6, True)  # gemma_norm: not faked
