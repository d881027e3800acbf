"""The `apply_token_bitmask` op: the torch reference against a token-by-token reading of the bits, and the Triton
kernel against the reference, exactly. Without a GPU the kernel runs in Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install 'omnirun[cuda]' or '[rocm]')")

from omnirun.kernels.triton.token_bitmask import apply_token_bitmask  # noqa: E402
from omnirun.sampling import token_bitmask as reference  # noqa: E402

pytestmark = pytest.mark.triton
DEVICE = torch.device("cpu")  # replaced per test by tests/kernels/conftest.py (the triton_device fixture)


def _inputs(rows: int, vocab: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(rows, vocab, generator=gen).to(dtype)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (rows, (vocab + 31) // 32), generator=gen, dtype=torch.int32)
    bitmask[0] = -1  # everything allowed
    return logits, bitmask


@pytest.mark.parametrize("vocab", [70, 4096, 5000])  # 70 and 5000 end mid-word; 5000 spans two blocks
def test_the_reference_masks_exactly_the_tokens_whose_bit_is_clear(vocab):
    logits, bitmask = _inputs(3, vocab, torch.float32)
    out = reference.apply_token_bitmask(logits, bitmask)
    for row in range(3):
        for token in range(vocab):
            allowed = (int(bitmask[row, token // 32]) >> (token % 32)) & 1
            assert out[row, token].item() == (logits[row, token].item() if allowed else float("-inf"))
    assert torch.equal(reference.allocate_token_bitmask(2, vocab), torch.full((2, (vocab + 31) // 32), -1).int())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("vocab", [70, 5000])
def test_kernel_equals_the_reference(vocab, dtype):
    logits, bitmask = _inputs(4, vocab, dtype)
    logits, bitmask = logits.to(DEVICE), bitmask.to(DEVICE)
    got = apply_token_bitmask(logits, bitmask)
    assert got.dtype == dtype and torch.equal(got, reference.apply_token_bitmask(logits, bitmask))
    assert torch.equal(got[0], logits[0])  # an all-ones row changes nothing
