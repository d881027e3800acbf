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


def test_float32_weights_take_k_in_smaller_blocks():
    """bf16's K blocks of 128 at 128 columns need 288 KiB of shared memory in float32: more than an H100 has."""
    assert tiles(28672, 4096).block_k == 128 and tiles(28672, 4096, element_size=4).block_k == 64
    assert tiles(4096, 14336, element_size=4).split_k == tiles(4096, 14336).split_k == 2


def test_pipeline_stages_shrink_to_the_shared_memory(monkeypatch):
    import omnirun.kernels.triton.matmul as matmul

    monkeypatch.setattr(matmul, "_INTERPRETING", False)
    monkeypatch.setattr(matmul, "_shared_memory_bytes", lambda index: 100 * 1024)  # a consumer GPU's 99 KiB + 1
    gpu = torch.device("cuda", 0)
    launch = Tiles(block_n=128, block_k=128)  # (64 + 128) x 128 x 2 B = 48 KiB a stage
    assert matmul._stages_that_fit(launch, 2, gpu) == 3  # two in flight fit, three do not
    assert matmul._stages_that_fit(Tiles(block_n=32, block_k=64), 2, gpu) == 4  # 12 KiB a stage: as tuned
    assert matmul._stages_that_fit(launch, 4, gpu) == 2  # never fewer than two
    monkeypatch.setattr(matmul, "_shared_memory_bytes", lambda index: None)  # a driver that does not say
    assert matmul._stages_that_fit(launch, 2, gpu) == launch.num_stages
