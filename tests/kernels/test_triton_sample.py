"""The sort-free Triton `sample` kernel against the torch reference (omnirun.sampling.reference): the same token for
the same random key, ties at the cuts included, and the filtered distribution itself. In Triton's interpreter on
CPU (few rows: it runs each program step by step) and compiled on GPUs (many)."""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: the sampling kernel needs it")

from omnirun.kernels.triton.sample import MAX_SHORTLIST, TIE_ROOM, sample  # noqa: E402
from omnirun.sampling import SamplingBatch, SamplingParams, reference  # noqa: E402

pytestmark = pytest.mark.triton
DEVICE = torch.device("cpu")  # replaced per test by tests/kernels/conftest.py (the triton_device fixture)


def _compiled() -> bool:
    return DEVICE.type != "cpu"


def _random_params(rows: int, seed: int) -> list[SamplingParams]:
    rng = random.Random(seed)
    return [
        SamplingParams(
            temperature=rng.choice([0.3, 0.7, 1.0, 1.6]),
            top_k=rng.choice([-1, 1, 2, 5, 17]),
            top_p=rng.choice([1.0, 0.95, 0.6, 0.2]),
            min_p=rng.choice([0.0, 0.0, 0.1]),
            seed=rng.randrange(2**63),
        )
        for _ in range(rows)
    ]


@pytest.mark.parametrize("shortlist", [True, False], ids=["shortlist", "search"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ties", [False, True])
def test_the_kernel_draws_the_references_token_for_every_key(dtype, ties, shortlist):
    """Seeded rows with every filter mixed: the same cuts (whole ties kept) and the same random numbers, so the
    same token, whether top-k rows cut a short list of their largest logits or search the whole row. Logits
    rounded to halves make ties at the k-th value and at the nucleus's end common."""
    rows, vocab = (512, 3000) if _compiled() else (48, 40)
    gen = torch.Generator().manual_seed(vocab + ties)
    logits = torch.randn(rows, vocab, generator=gen) * 2
    if ties:
        logits = (logits * 2).round() / 2
    logits = logits.to(dtype).to(DEVICE)
    batch = SamplingBatch.build(_random_params(rows, vocab), list(range(rows)), DEVICE, vocab_size=vocab)
    expected = reference.sample(logits, batch)
    got = sample(logits, batch, shortlist=shortlist)
    assert got.dtype == torch.int64 and got.shape == (rows,)
    assert torch.equal(got.cpu(), expected.cpu())


def test_a_tie_longer_than_the_short_list_searches_the_whole_row():
    """Row 0's k-th value is shared by more tokens than the short list has room for past k: the list cannot tell
    where that tie ends, so the row must search (a cut inside the list would drop part of the tie). Row 1 fits."""
    vocab, k = 300, 3
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(2, vocab, generator=gen) - 5
    logits[:, : k - 1] = 4.0
    logits[0, 100 : 100 + 2 * TIE_ROOM] = 1.0  # the k-th value, shared by 2 * TIE_ROOM tokens
    logits[1, 100] = 1.0
    params = [SamplingParams(temperature=3.0, top_k=k, seed=row) for row in range(2)]
    batch = SamplingBatch.build(params, [0, 0], DEVICE, vocab_size=vocab)
    logits = logits.to(DEVICE)
    kept = reference.filtered_probs(logits, batch) > 0
    assert kept.sum(dim=-1).tolist() == [k - 1 + 2 * TIE_ROOM, k]
    assert torch.equal(sample(logits, batch).cpu(), reference.sample(logits, batch).cpu())
    # Many unseeded draws of row 0: the tie's tokens past the list's room are drawn too.
    torch.manual_seed(0)
    copies = 128 if _compiled() else 64  # the interpreter runs each copy's program step by step
    unseeded = SamplingBatch.build([SamplingParams(temperature=3.0, top_k=k)] * copies, [0] * copies, DEVICE, vocab)
    draws = sample(logits[:1].expand(copies, -1).contiguous(), unseeded).cpu()
    assert kept[0, draws].all()
    assert len(set(draws.tolist()) - {0, 1}) > TIE_ROOM + 1, "drew only from the listed part of the tie"


def test_top_p_rows_without_top_k_cut_a_listed_nucleus_or_search():
    """Rows with top-p and no top-k list the MAX_SHORTLIST largest logits: a nucleus that ends inside the list with
    its whole tie is cut there, any other searches the whole row. Rows 0-31 are one staircase (a nucleus of a few
    listed tokens, the next one likely enough to be drawn if the cut kept it) under 32 seeds, row 32 is flat (its
    nucleus is not listed), and row 33's nucleus ends in a tie of 1,990 tokens that the list holds only part of."""
    vocab, seeds = MAX_SHORTLIST + 976, 32
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(seeds + 2, vocab, generator=gen)
    logits[:seeds] -= 8.0
    logits[:seeds, :8] = 3.0 - 0.4 * torch.arange(8.0)
    logits[seeds + 1] = 0.0
    logits[seeds + 1, :10] = 5.0
    params = [SamplingParams(temperature=1.0, top_p=0.7, seed=row) for row in range(seeds + 1)]
    params.append(SamplingParams(temperature=1.0, top_p=0.6, seed=2))
    batch = SamplingBatch.build(params, [0] * len(params), DEVICE, vocab_size=vocab)
    assert batch.any_top_p_alone
    logits = logits.to(DEVICE)
    kept = reference.filtered_probs(logits, batch) > 0
    assert kept[seeds + 1].sum() == vocab  # the tie at the cut keeps all of it
    expected = reference.sample(logits, batch).cpu()
    assert len(set(expected[:seeds].tolist())) >= 3  # the staircase's draws spread over its nucleus
    assert torch.equal(sample(logits, batch).cpu(), expected)
    torch.manual_seed(0)
    copies = 64
    unseeded = SamplingBatch.build([SamplingParams(top_p=0.6)] * copies, [0] * copies, DEVICE, vocab)
    tied = logits[seeds + 1 :].expand(copies, -1).contiguous()
    draws = sample(tied, unseeded).cpu()
    listed = set(torch.topk(tied[0], MAX_SHORTLIST).indices.tolist())
    assert set(draws.tolist()) - listed, "drew only from the listed part of the tie"


def _filtered_distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a row samples from, written the slow, obvious way (float64, one token at a time): top-k
    keeps the k-th value's ties, top-p the ties of the last token its nucleus needs, min-p what reaches min_p of
    the most likely token."""
    probs = torch.softmax(logits.double() / params.temperature, -1)
    values = sorted(set(probs.tolist()), reverse=True)
    keep = torch.ones_like(probs, dtype=torch.bool)
    if params.top_k > 0:
        kth = sorted(probs.tolist(), reverse=True)[params.top_k - 1]
        keep &= probs >= kth
    if params.top_p < 1:
        kept = probs * keep / (probs * keep).sum()
        mass, last = 0.0, values[0]
        for value in values:
            if mass >= params.top_p:
                break
            last = value
            mass += float(kept[probs == value].sum())
        keep &= probs >= last
    if params.min_p > 0:
        keep &= probs >= params.min_p * probs.max()
    filtered = probs * keep
    return filtered / filtered.sum()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.8),
        SamplingParams(temperature=0.9, top_k=3),
        SamplingParams(temperature=1.2, top_p=0.7),
        SamplingParams(temperature=0.9, top_k=5, top_p=0.8, min_p=0.1),
    ],
    ids=["temperature", "top_k", "top_p", "all"],
)
@pytest.mark.parametrize("implementation", ["kernel", "reference"])
def test_draws_follow_the_filtered_distribution(params, implementation):
    """Many draws of one row (as a batch of copies with unseeded keys) against the exact filtered distribution:
    nothing outside it, and a chi-square far inside its bounds."""
    if implementation == "kernel" and not _compiled():
        # The interpreter runs each of 20,000 programs step by step (a minute even unfiltered, minutes filtered);
        # there the token-by-token tests above hold the kernel to the reference, whose distributions this checks.
        pytest.skip("many draws: compiled devices only (the interpreter takes minutes)")
    draws = 20_000
    logits_row = torch.tensor([2.0, 1.5, 1.0, 1.0, 0.3, -0.5, -1.0, 0.8, 1.7, 1.5])
    expected = _filtered_distribution(logits_row, params)
    torch.manual_seed(7)
    logits = logits_row.expand(draws, -1).contiguous().to(DEVICE)
    batch = SamplingBatch.build([params] * draws, [0] * draws, DEVICE, vocab_size=logits.shape[1])
    draw = sample if implementation == "kernel" else reference.sample
    counts = torch.bincount(draw(logits, batch).cpu(), minlength=logits.shape[1]).double()
    assert counts[expected == 0].sum() == 0, "a filtered token was drawn"
    support = expected > 0
    wanted = expected[support] * draws
    chi_square = float(((counts[support] - wanted) ** 2 / wanted).sum())
    # dof <= 9: its 99.9 % quantile is 27.9; a wrong distribution (a missing renormalisation, a lost tie) gives
    # far more at these numbers of draws.
    assert chi_square < 40, (counts.tolist(), (expected * draws).tolist())


def test_rows_past_the_vocabulary_block_and_tiny_temperatures():
    """A vocabulary over several blocks (the last one partial), a row whose best token sits in the last block, and
    a temperature small enough to overflow without the row-max shift: the kernel still equals the reference."""
    vocab = 9000 if _compiled() else 5000
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, vocab, generator=gen)
    logits[0, vocab - 2] = 10.0
    params = [
        SamplingParams(temperature=1e-4, seed=1),
        SamplingParams(temperature=1.0, top_k=2, seed=2),
        SamplingParams(temperature=1.0, top_p=0.5, seed=3),
    ]
    batch = SamplingBatch.build(params, [0, 0, 0], DEVICE, vocab_size=vocab)
    logits = logits.to(DEVICE)
    got = sample(logits, batch)
    assert got[0] == vocab - 2
    assert torch.equal(got.cpu(), reference.sample(logits, batch).cpu())


@pytest.mark.parametrize("pivots", [2, 4])
def test_fewer_pivots_per_pass_find_the_same_cuts(pivots):
    """The search tries 16 cuts per pass by default; 2 (a bisection) and 4 must land on the same cuts."""
    rows, vocab = (256, 3000) if _compiled() else (24, 60)
    gen = torch.Generator().manual_seed(pivots)
    logits = ((torch.randn(rows, vocab, generator=gen) * 4).round() / 2).to(DEVICE)
    batch = SamplingBatch.build(_random_params(rows, pivots), list(range(rows)), DEVICE, vocab_size=vocab)
    assert torch.equal(sample(logits, batch, pivots=pivots).cpu(), reference.sample(logits, batch).cpu())


@pytest.mark.parametrize("mix", ["narrow", "nucleus", "no_list"])
def test_the_graph_form_draws_the_eager_token(mix):
    """A decode graph's sampler (omnirun.sampling.graph_form): every flag set, the captured list width, and each
    row's eager list length and nucleus flag read from the device; the same tokens as the same batch eagerly, with
    a narrow list, the long one top-p rows without top-k make, and none (a top-k longer than any list)."""
    from omnirun.sampling.graph_form import graph_batch, plan_step
    from omnirun.sampling.shortlist import GRAPH_WIDTHS

    rows, vocab = (256, 3000) if _compiled() else (10, 1300)
    rng = random.Random(mix)
    kinds = {
        "narrow": [dict(top_k=5), dict(top_k=17, top_p=0.8), dict(top_k=40, min_p=0.05), dict(), dict(temperature=0)],
        "nucleus": [dict(top_p=0.7), dict(top_k=9, top_p=0.9), dict(top_p=0.95, min_p=0.02), dict(temperature=0)],
        "no_list": [dict(), dict(min_p=0.1), dict(top_k=1100, top_p=0.9), dict(top_p=0.6), dict(temperature=0)],
    }[mix]
    params = [
        SamplingParams(**{"temperature": rng.choice([0.5, 1.0, 1.4]), **rng.choice(kinds)}, seed=rng.randrange(99))
        for _ in range(rows)
    ]
    gen = torch.Generator().manual_seed(rows)
    logits = ((torch.randn(rows, vocab, generator=gen) * 4).round() / 2).to(DEVICE)  # ties at the cuts
    index = list(range(rows))
    step = plan_step(params, index, vocab, rows, GRAPH_WIDTHS)
    assert step.width == {"narrow": 128, "nucleus": 1024, "no_list": 0}[mix]
    graph = graph_batch(step.host.to(DEVICE), step.width)
    eager = SamplingBatch.build(params, index, DEVICE, vocab_size=vocab)
    assert torch.equal(graph.greedy, eager.greedy) and torch.equal(graph.keys, eager.keys)
    assert torch.equal(sample(logits, graph).cpu(), sample(logits, eager).cpu())
