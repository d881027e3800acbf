"""The one-launch argmax (cuda's greedy pick) against the torch reference: first index of each row's maximum, the
state it resets for the next launch, NaNs, in Triton's interpreter on CPU and compiled on GPUs."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: the argmax kernel needs it")

from omnirun.devices.cuda.argmax import TritonArgmax  # noqa: E402
from omnirun.layers import native_ops  # noqa: E402

pytestmark = pytest.mark.triton
DEVICE = torch.device("cpu")  # replaced per test by tests/kernels/conftest.py (the triton_device fixture)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(("rows", "vocab"), [(1, 128_256), (3, 10_000), (5, 4_096), (2, 17), (40, 32_000)])
def test_argmax_is_the_first_index_of_each_rows_maximum(dtype, rows, vocab):
    gen = torch.Generator().manual_seed(rows * vocab)
    logits = torch.randn(rows, vocab, generator=gen).to(dtype)
    top = logits.max(dim=-1).values
    logits[0, vocab // 2] = logits[0, vocab - 1] = top[0]  # ties, also in other chunks than the first maximum
    logits[-1] = -logits[-1].abs() - 1  # a row of negative numbers only
    logits = logits.to(DEVICE)
    argmax = TritonArgmax()
    expected = logits.cpu().max(dim=-1).indices
    for _ in range(3):  # the row keys and counts are reset by each launch for the next
        got = argmax(logits)
        assert got.dtype == torch.int64 and torch.equal(got.cpu(), expected)
    assert torch.equal(native_ops.argmax(logits).cpu(), expected)


def test_argmax_takes_a_nan_as_the_maximum_as_torch_does():
    logits = torch.full((2, 9_000), -3.0)
    logits[0, 100] = float("inf")
    logits[1, 8_000] = logits[1, 8_001] = float("nan")
    logits[1, 5] = float("inf")
    got = TritonArgmax()(logits.to(torch.bfloat16).to(DEVICE)).cpu()
    assert got.tolist() == logits.max(dim=-1).indices.tolist() == [100, 8_000]


def test_argmax_grows_its_state_and_keeps_what_it_outgrew():
    argmax = TritonArgmax()
    small = torch.randn(2, 5_000).to(DEVICE)
    assert torch.equal(argmax(small).cpu(), small.cpu().argmax(-1))
    big = torch.randn(1_500, 300).to(DEVICE)
    assert torch.equal(argmax(big).cpu(), big.cpu().argmax(-1))
    (made,) = argmax._scratch_made.values()
    assert [keys.numel() for keys, _ in made] == [1_024, 2_048]  # the first pair stays alive for captured graphs
    assert torch.equal(argmax(small).cpu(), small.cpu().argmax(-1))
    assert argmax(torch.empty(0, 10, device=DEVICE)).shape == (0,)
