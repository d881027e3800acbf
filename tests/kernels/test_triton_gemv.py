"""The one-row GEMV (CUDA's `linear` for small weights) against torch's matmul, in Triton's interpreter on CPU and
compiled on GPUs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="triton is not installed: the GEMV needs it")

from omnirun.devices.cuda.gemv import GEMV_MAX_WEIGHT_ELEMENTS, gemv, linear  # noqa: E402

pytestmark = pytest.mark.triton
DEVICE = torch.device("cpu")  # replaced per test by tests/kernels/conftest.py (the triton_device fixture)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("m", "n", "k"), [(1, 100, 300), (1, 64, 2048), (3, 33, 520), (1, 7, 64)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv_equals_a_float32_matmul_rounded_once(dtype, m, n, k, with_bias):
    gen = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=gen).to(dtype).to(DEVICE)
    w = torch.randn(n, k, generator=gen).to(dtype).to(DEVICE)
    b = torch.randn(n, generator=gen).to(dtype).to(DEVICE) if with_bias else None
    reference = x.float() @ w.float().T + (b.float() if with_bias else 0)
    out = gemv(x, w, b, block_n=16, block_k=128)
    assert out.dtype == dtype and out.shape == (m, n)
    # float32 accumulation in another order, then one rounding to the output dtype
    torch.testing.assert_close(out.float(), reference, rtol=2e-3 if dtype == torch.float16 else 8e-3, atol=1e-3)


def test_linear_takes_the_gemv_for_one_row_and_torch_otherwise(monkeypatch):
    import omnirun.devices.cuda.gemv as module

    calls = []
    monkeypatch.setattr(module, "gemv", lambda *a, **kw: calls.append(a[0].shape) or F.linear(*a[:3]))
    w = torch.randn(64, 128, dtype=torch.bfloat16, device=DEVICE)
    x = torch.randn(4, 128, dtype=torch.bfloat16, device=DEVICE)
    for rows in (1, 4):
        torch.testing.assert_close(linear(x[:rows], w, None), F.linear(x[:rows], w))
    linear(x[:1].float(), w.float(), None)  # float32: torch's
    assert calls == [(1, 128)]
    assert GEMV_MAX_WEIGHT_ELEMENTS < 4096 * 14336  # an 8B model's MLP weights stay with torch


def test_gemv_at_a_real_shape_with_the_tuned_launch(compiled_triton_platform):
    x = torch.randn(1, 4096, dtype=torch.bfloat16, device=DEVICE)
    w = torch.randn(6144, 4096, dtype=torch.bfloat16, device=DEVICE) / 64
    torch.testing.assert_close(linear(x, w, None).float(), x.float() @ w.float().T, rtol=8e-3, atol=2e-3)
