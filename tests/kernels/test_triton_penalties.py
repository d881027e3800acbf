"""The Triton `apply_penalties` kernel against its torch reference (omnirun.sampling.adjust.apply_penalties).

Every step is an IEEE operation the kernel performs as torch does (no FMA, division rounded to nearest), so the
results are compared bit for bit. Without a GPU the kernel runs in Triton's interpreter.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install 'omnirun[cuda]' or '[rocm]')")

from omnirun.kernels.triton.penalties import apply_penalties  # noqa: E402
from omnirun.sampling import adjust  # noqa: E402

pytestmark = pytest.mark.triton
DEVICE = torch.device("cpu")  # replaced per test by tests/kernels/conftest.py (the triton_device fixture)


def _inputs(batch: int, vocab: int, pool_rows: int, dtype: torch.dtype, with_prompt: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(batch, vocab, generator=gen) * 4).to(dtype)
    # Sparse counts, as outputs make them: most tokens unseen, some seen once, a few many times.
    counts = torch.randint(0, 4, (pool_rows, vocab), generator=gen, dtype=torch.int32)
    counts *= torch.rand(pool_rows, vocab, generator=gen) < 0.2
    prompt_seen = torch.rand(pool_rows, vocab, generator=gen) < 0.1 if with_prompt else None
    rows = torch.randperm(pool_rows, generator=gen)[:batch]
    repetition = torch.rand(batch, generator=gen) * 1.5 + 0.5
    repetition[0] = 1.0  # a row with the repetition penalty off
    frequency = torch.randn(batch, generator=gen)
    presence = torch.randn(batch, generator=gen)
    frequency[1] = presence[1] = 0.0  # and one with frequency and presence off
    tensors = (logits, counts, prompt_seen, rows, repetition, frequency, presence)
    return tuple(t if t is None else t.to(DEVICE) for t in tensors)


@pytest.mark.parametrize("with_prompt", [True, False], ids=["repetition", "no-repetition"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_kernel_equals_the_reference_bit_for_bit(dtype, with_prompt):
    args = _inputs(batch=5, vocab=5_000, pool_rows=9, dtype=dtype, with_prompt=with_prompt)
    got = apply_penalties(*args)
    expected = adjust.apply_penalties(*args)
    assert got.dtype == torch.float32 and got.shape == expected.shape
    assert torch.equal(got, expected)


def test_each_batch_row_reads_the_pool_row_it_names():
    """Two batch rows pointing at the same pool row get the same penalties; the logits are left as they were."""
    logits, counts, prompt_seen, _, repetition, frequency, presence = _inputs(4, 300, 6, torch.float32, True)
    rows = torch.tensor([5, 2, 5, 0], device=DEVICE)
    repetition[:] = 1.3
    frequency[:] = 0.5
    presence[:] = 0.25
    logits[2] = logits[0]
    before = logits.clone()
    got = apply_penalties(logits, counts, prompt_seen, rows, repetition, frequency, presence)
    assert torch.equal(got[0], got[2])
    assert torch.equal(got, adjust.apply_penalties(logits, counts, prompt_seen, rows, repetition, frequency, presence))
    assert torch.equal(logits, before)
    changed = (got != logits).sum(-1)
    assert (changed > 0).all()  # every row has counted tokens: a kernel that skipped the penalties shows here
