"""The batch-invariant Triton matmul (deterministic mode's linear) against torch's matmul, and its rows against
the same rows computed with any other number of rows: in Triton's interpreter on CPU and compiled on GPUs."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: the matmul needs it")

from omnirun.kernels.triton.matmul import BLOCK_M, Tiles, batch_invariant_linear, tiles  # noqa: E402

pytestmark = pytest.mark.triton
DEVICE = torch.device("cpu")  # replaced per test by tests/kernels/conftest.py (the triton_device fixture)


def _operands(m: int, n: int, k: int, dtype: torch.dtype, with_bias: bool):
    gen = torch.Generator().manual_seed(m + n * k)
    x = torch.randn(m, k, generator=gen).to(dtype).to(DEVICE)
    w = torch.randn(n, k, generator=gen).to(dtype).to(DEVICE)
    b = torch.randn(n, generator=gen).to(dtype).to(DEVICE) if with_bias else None
    return x, w, b


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("m", "n", "k"), [(1, 100, 300), (70, 33, 130), (3, 8200, 64)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("launch", [None, Tiles(block_n=16, block_k=32, split_k=3)], ids=["default", "split3"])
def test_matmul_equals_torch_in_float32(dtype, m, n, k, with_bias, launch):
    x, w, b = _operands(m, n, k, dtype, with_bias)
    reference = x.float() @ w.float().T + (b.float() if with_bias else 0)
    out = batch_invariant_linear(x, w, b, launch=launch)
    assert out.dtype == dtype and out.shape == (m, n)
    tolerance = 8e-3 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(out.float(), reference, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("launch", [None, Tiles(block_n=32, block_k=32, split_k=4)], ids=["default", "split4"])
def test_a_row_is_the_same_whatever_rows_come_with_it(launch):
    import triton

    x, w, b = _operands(2 * BLOCK_M + 5, 96, 200, torch.bfloat16, True)
    whole = batch_invariant_linear(x, w, b, launch=launch)
    cuts = [slice(0, 1), slice(0, 7), slice(0, BLOCK_M + 9), slice(BLOCK_M, 2 * BLOCK_M + 5)]
    # Rows moved within a tile only compiled: the interpreter's tl.dot is numpy's matmul, which rounds a row
    # differently by where it sits in the tile (a GPU's MMA does not).
    if not triton.knobs.runtime.interpret:
        cuts += [slice(3, 4), slice(5, BLOCK_M + 9)]
    for rows in cuts:
        assert torch.equal(batch_invariant_linear(x[rows], w, b, launch=launch), whole[rows]), rows
    assert batch_invariant_linear(x.view(1, -1, 200), w, None).shape == (1, x.shape[0], 96)


def test_tiles_follow_the_weight_alone():
    for n, k in ((4096, 4096), (6144, 4096), (28672, 4096), (4096, 14336), (128256, 4096), (33, 130)):
        launch = tiles(n, k)
        assert launch.block_n in (16, 32, 64, 128, 256) and launch.split_k >= 1
