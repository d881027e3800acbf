"""Sampling parameters and the batched sampler, checked against argmax, softmax references and hand-built cases."""

from __future__ import annotations

import math

import pytest
import torch

from omnirun.errors import SamplingParamsError
from omnirun.sampling import SampleOutput, Sampler, SamplingBatch, SamplingParams
from omnirun.sampling.counter_rng import exponentials, row_key

DRAWS = 20000


def sample(logits: torch.Tensor, params: list[SamplingParams], token_index: list[int] | None = None) -> SampleOutput:
    index = token_index if token_index is not None else [0] * len(params)
    return Sampler()(logits, SamplingBatch.build(params, index, logits.device))


def frequencies(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).double() / tokens.numel()


def draw_many(logits_row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """DRAWS independent samples of one distribution, as one batch of identical rows."""
    torch.manual_seed(1234)
    return sample(logits_row.expand(DRAWS, -1).contiguous(), [params] * DRAWS).token_ids


# --- SamplingParams validation ---


@pytest.mark.parametrize(
    ("field", "value", "range_words"),
    [
        ("max_new_tokens", -1, ">= 0"),
        ("max_new_tokens", 2.5, ">= 0"),
        ("prompt_logprobs", -1, ">= 0"),
        ("temperature", -0.1, ">= 0"),
        ("temperature", float("nan"), "finite"),
        ("temperature", float("inf"), "finite"),
        ("top_p", 0.0, "(0, 1]"),
        ("top_p", 1.5, "(0, 1]"),
        ("top_p", -0.2, "(0, 1]"),
        ("top_k", -2, "-1 or 0"),
        ("top_k", 2.0, "-1 or 0"),
        ("top_k", True, "-1 or 0"),
        ("min_p", -0.01, "[0, 1]"),
        ("min_p", 1.01, "[0, 1]"),
        ("seed", 1.5, "an int"),
        ("seed", "42", "an int"),
        ("logprobs", -1, ">= 0"),
        ("logprobs", 1.0, ">= 0"),
        ("stop", [""], "non-empty string"),
        ("stop", 5, "non-empty string"),
        ("stop_token_ids", [-1], "ints >= 0"),
        ("ignore_eos", "yes", "True or False"),
    ],
)
def test_each_bad_value_raises_one_line_naming_field_value_and_range(field, value, range_words):
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**{field: value})
    message = str(info.value)
    assert "\n" not in message
    assert f"SamplingParams.{field}=" in message
    assert repr(value) in message
    assert range_words in message


def test_defaults_and_normalisation():
    p = SamplingParams()
    assert (p.max_new_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (16, 1.0, 1.0, -1, 0.0)
    assert p.seed is None and p.logprobs is None and not p.ignore_eos
    assert p.stop == [] and p.stop_token_ids == []
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b"), stop_token_ids=(2, 3)).stop == ["a", "b"]
    as_float = SamplingParams(temperature=1).temperature
    assert as_float == 1.0 and isinstance(as_float, float)
    # Boundary values are valid.
    SamplingParams(temperature=0, top_p=1.0, top_k=0, min_p=1.0, logprobs=0, seed=-7, max_new_tokens=1)


def test_greedy_property():
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(top_k=1).greedy
    assert not SamplingParams().greedy
    assert not SamplingParams(top_k=0).greedy
    assert not SamplingParams(temperature=0.01, top_k=2).greedy


# --- SamplingBatch ---


def test_batch_tensors_and_flags():
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.5, top_k=5, seed=3),
        SamplingParams(top_p=0.9, min_p=0.1, logprobs=4),
        SamplingParams(top_k=0, logprobs=0),
    ]
    b = SamplingBatch.build(params, [0, 2, 0, 1], torch.device("cpu"), vocab_size=100)
    assert b.temperatures.dtype == torch.float32 and b.temperatures.tolist() == [1.0, 0.5, 1.0, 1.0]
    assert b.top_ks.dtype == torch.int64 and b.top_ks.tolist() == [100, 5, 100, 100]
    assert b.top_ps.tolist() == pytest.approx([1.0, 1.0, 0.9, 1.0])
    assert b.min_ps.tolist() == pytest.approx([0.0, 0.0, 0.1, 0.0])
    assert b.greedy.tolist() == [True, False, False, False]
    assert b.keys.dtype == torch.int64 and b.keys[1] == row_key(3, 2)
    assert (b.all_greedy, b.any_top_k, b.any_top_p, b.any_min_p, b.max_logprobs) == (False, True, True, True, 4)

    only_greedy = SamplingBatch.build([SamplingParams(temperature=0, top_p=0.5)] * 2, [0, 0], "cpu")
    assert only_greedy.all_greedy and not only_greedy.any_top_p and only_greedy.max_logprobs == -1
    assert only_greedy.keys is None  # nothing to draw


def test_batch_needs_one_token_index_per_request():
    with pytest.raises(SamplingParamsError, match="one token index per request"):
        SamplingBatch.build([SamplingParams()] * 2, [0], "cpu")


# --- greedy ---


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_exactly_argmax(dtype):
    torch.manual_seed(0)
    logits = (torch.randn(16, 300) * 3).to(dtype)
    out = sample(logits, [SamplingParams(temperature=0)] * 16)
    assert out.token_ids.dtype == torch.int64
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert out.logprobs is None and out.top_logprobs is None


def test_greedy_ties_take_the_first_maximum_in_bf16():
    logits = torch.zeros(3, 50, dtype=torch.bfloat16)
    logits[0, [7, 20]] = 2.0
    logits[1, [3, 4, 49]] = 1.0
    # 1.0 and 1.0 + 2**-10 are one bf16 value: the tie appears only after rounding.
    logits[2, 30] = 1.0
    logits[2, 10] = 1.0 + 2**-10
    out = sample(logits, [SamplingParams(temperature=0)] * 3)
    assert out.token_ids.tolist() == [7, 3, 10]
    assert torch.equal(out.token_ids, logits.argmax(-1))


@pytest.mark.parametrize("rows", [1, 3, 40])  # below and above the two-stage threshold
@pytest.mark.parametrize("vocab", [8192, 151_936, 128_256 + 5])  # whole chunks, and a partial last chunk
def test_greedy_over_large_vocabularies_keeps_the_first_maximum(rows, vocab):
    """The chunked reduction for few rows: exactly argmax, ties across chunks and in the partial chunk included."""
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(vocab)).to(torch.bfloat16)
    logits[0, [vocab - 1, 4095, 4096]] = 9.0  # equal maxima in two chunks and the last position
    logits[-1, [vocab - 2, vocab - 1]] = 9.0  # a tie inside the last (partial) chunk
    out = sample(logits, [SamplingParams(temperature=0)] * rows)
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert out.token_ids[0] == 4095 and out.token_ids[-1] == (vocab - 2 if rows > 1 else 4095)


def test_top_k_one_equals_greedy():
    torch.manual_seed(1)
    logits = torch.randn(64, 500)
    out = sample(logits, [SamplingParams(temperature=1.3, top_k=1)] * 64)
    assert torch.equal(out.token_ids, logits.argmax(-1))


def test_tiny_temperature_is_argmax_without_nan():
    torch.manual_seed(2)
    logits = torch.randn(32, 100) * 50
    out = sample(logits, [SamplingParams(temperature=1e-30)] * 32)
    assert torch.equal(out.token_ids, logits.argmax(-1))


def test_top_p_tiny_keeps_only_the_most_likely_token():
    torch.manual_seed(3)
    logits = torch.randn(1, 40).expand(DRAWS, -1).contiguous()
    out = sample(logits, [SamplingParams(temperature=1.0, top_p=1e-6)] * DRAWS)
    assert torch.equal(out.token_ids, logits.argmax(-1))


# --- filters and distributions ---


def test_min_p_drops_tokens_below_threshold():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.04, 0.01])
    # threshold = min_p * p_max = 0.1 * 0.5 = 0.05: tokens 3 and 4 are out, token 2 (0.15) is in.
    tokens = draw_many(probs.log(), SamplingParams(min_p=0.1))
    freq = frequencies(tokens, 5)
    assert freq[3] == 0 and freq[4] == 0
    kept = probs[:3] / probs[:3].sum()
    assert (freq[:3] - kept.double()).abs().max() < 0.02
    assert freq[2] > 0.1


def test_without_min_p_the_small_tokens_are_sampled():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.04, 0.01])
    freq = frequencies(draw_many(probs.log(), SamplingParams()), 5)
    assert freq[3] > 0.02 and freq[4] > 0.003


LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.3, -0.5, -1.0, 0.8, 1.7])


def nucleus_reference(logits: torch.Tensor, temperature: float, top_p: float, top_k: int = -1) -> torch.Tensor:
    """The filtered distribution, written the slow, obvious way."""
    probs = torch.softmax(logits.double() / temperature, -1)
    order = probs.argsort(descending=True).tolist()
    if top_k > 0:
        order = order[:top_k]
    kept_probs = probs[order] / probs[order].sum()
    keep, mass = [], 0.0
    for token, p in zip(order, kept_probs.tolist(), strict=True):
        if mass >= top_p:
            break
        keep.append(token)
        mass += p
    ref = torch.zeros_like(probs)
    ref[keep] = probs[keep] / probs[keep].sum()
    return ref


def chi_square_ok(freq: torch.Tensor, expected: torch.Tensor) -> bool:
    support = expected > 0
    obs = freq[support] * DRAWS
    exp = expected[support] * DRAWS
    stat = ((obs - exp) ** 2 / exp).sum().item()
    dof = int(support.sum()) - 1
    # Far beyond the 99.9% quantile for dof <= 8 (26.1), while a wrong distribution gives hundreds.
    return stat < 40 and dof >= 0


@pytest.mark.parametrize(
    ("temperature", "top_p", "top_k"),
    [(0.7, 1.0, -1), (1.0, 1.0, 0), (1.0, 0.8, -1), (0.7, 0.8, -1), (1.5, 1.0, 3), (0.9, 0.6, 4)],
)
def test_empirical_distribution_matches_filtered_softmax(temperature, top_p, top_k):
    tokens = draw_many(LOGITS, SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k))
    freq = frequencies(tokens, LOGITS.numel())
    expected = nucleus_reference(LOGITS, temperature, top_p, top_k)
    assert (freq[expected == 0] == 0).all()
    assert (freq - expected).abs().max() < 0.02
    assert chi_square_ok(freq, expected)


def test_top_p_nucleus_is_cut_where_expected():
    # Nucleus of 0.8 over [0.4, 0.25, 0.2, 0.1, 0.05]: mass before each is [0, .4, .65, .85, .95] -> keep 3.
    probs = torch.tensor([0.1, 0.4, 0.05, 0.25, 0.2])
    freq = frequencies(draw_many(probs.log(), SamplingParams(top_p=0.8)), 5)
    expected = torch.tensor([0.0, 0.4, 0.0, 0.25, 0.2], dtype=torch.float64) / 0.85
    assert freq[0] == 0 and freq[2] == 0
    assert (freq - expected).abs().max() < 0.02


def test_distribution_is_right_for_half_precision_logits():
    logits = LOGITS.to(torch.bfloat16)
    freq = frequencies(draw_many(logits, SamplingParams(temperature=0.7)), LOGITS.numel())
    expected = torch.softmax(logits.double() / 0.7, -1)
    assert (freq - expected).abs().max() < 0.02


# --- seeds ---


def seeded_tokens(seed: int, position: int, batch_size: int, steps_logits: list[torch.Tensor]) -> list[int]:
    """The tokens a request seeded with `seed` gets at `position` of a batch of otherwise unseeded rows."""
    tokens = []
    for step, row_logits in enumerate(steps_logits):
        torch.manual_seed(1000 + step * 7 + batch_size + position)  # the global RNG differs every time
        logits = torch.randn(batch_size, row_logits.numel())
        logits[position] = row_logits
        params = [SamplingParams(temperature=1.0, top_p=0.95) for _ in range(batch_size)]
        params[position] = SamplingParams(temperature=0.9, top_k=50, seed=seed)
        out = sample(logits, params, token_index=[step] * batch_size)
        tokens.append(int(out.token_ids[position]))
    return tokens


@pytest.fixture
def steps_logits() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(99)
    return [torch.randn(200, generator=gen) for _ in range(12)]


def test_seeded_request_is_reproducible_whatever_else_is_in_the_batch(steps_logits):
    alone = seeded_tokens(42, position=0, batch_size=1, steps_logits=steps_logits)
    assert seeded_tokens(42, position=0, batch_size=1, steps_logits=steps_logits) == alone
    assert seeded_tokens(42, position=3, batch_size=8, steps_logits=steps_logits) == alone
    assert seeded_tokens(42, position=6, batch_size=8, steps_logits=steps_logits) == alone
    assert seeded_tokens(42, position=1, batch_size=5, steps_logits=steps_logits) == alone


def test_different_seeds_and_token_indices_differ(steps_logits):
    a = seeded_tokens(42, 0, 1, steps_logits)
    b = seeded_tokens(43, 0, 1, steps_logits)
    assert a != b
    # The same logits at every step: the token index alone must change the draw.
    same = [steps_logits[0]] * 12
    assert len(set(seeded_tokens(42, 0, 1, same))) > 1


def test_two_rows_with_the_same_seed_in_one_batch_agree():
    torch.manual_seed(5)
    logits = torch.randn(1, 300).expand(4, -1).contiguous()
    params = [SamplingParams(seed=7), SamplingParams(), SamplingParams(seed=7), SamplingParams()]
    out = sample(logits, params)
    assert out.token_ids[0] == out.token_ids[2]


def test_unseeded_rows_follow_the_global_rng():
    logits = torch.zeros(16, 1000)
    torch.manual_seed(11)
    first = sample(logits, [SamplingParams()] * 16).token_ids
    torch.manual_seed(11)
    again = sample(logits, [SamplingParams()] * 16).token_ids
    assert torch.equal(first, again)
    assert not torch.equal(first, sample(logits, [SamplingParams()] * 16).token_ids)


# --- logprobs ---


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_are_log_softmax_of_raw_logits(dtype):
    torch.manual_seed(6)
    logits = (torch.randn(5, 64) * 2).to(dtype)
    params = [
        SamplingParams(temperature=0.5, top_k=10, logprobs=3),
        SamplingParams(temperature=0, logprobs=0),
        SamplingParams(top_p=0.7, logprobs=5),
        SamplingParams(min_p=0.2),
        SamplingParams(temperature=2.0, logprobs=1, seed=9),
    ]
    out = sample(logits, params)
    reference = torch.log_softmax(logits.float(), dim=-1)
    assert out.logprobs.dtype == torch.float32
    torch.testing.assert_close(out.logprobs, reference.gather(-1, out.token_ids[:, None]).squeeze(-1))
    assert out.top_logprobs.shape == (5, 5) and out.top_logprob_ids.shape == (5, 5)
    assert (out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:]).all()
    torch.testing.assert_close(out.top_logprobs, reference.gather(-1, out.top_logprob_ids))
    torch.testing.assert_close(out.top_logprobs, reference.topk(5, dim=-1).values)
    assert out.token_ids[1] == logits[1].argmax()


def test_logprobs_zero_gives_chosen_only():
    out = sample(torch.randn(2, 10), [SamplingParams(logprobs=0), SamplingParams()])
    assert out.logprobs is not None and out.logprobs.shape == (2,)
    assert out.top_logprobs is None and out.top_logprob_ids is None


def test_top_n_larger_than_vocab_is_clamped():
    out = sample(torch.randn(1, 4), [SamplingParams(logprobs=10)])
    assert out.top_logprobs.shape == (1, 4)
    torch.testing.assert_close(out.top_logprobs.exp().sum(), torch.tensor(1.0))


# --- mixed batches ---


def test_mixed_greedy_and_sampled_rows():
    torch.manual_seed(8)
    batch = 64
    logits = torch.randn(batch, 1000) * 0.1  # nearly flat: a sampled row rarely hits the argmax
    greedy_rows = list(range(0, batch, 2))
    params = [
        SamplingParams(temperature=0) if i in greedy_rows else SamplingParams(temperature=1.0, top_p=0.9, min_p=0.01)
        for i in range(batch)
    ]
    out = sample(logits, params)
    argmax = logits.argmax(-1)
    assert torch.equal(out.token_ids[greedy_rows], argmax[greedy_rows])
    sampled_rows = [i for i in range(batch) if i not in greedy_rows]
    assert (out.token_ids[sampled_rows] != argmax[sampled_rows]).sum() > len(sampled_rows) // 2


def test_filtered_tokens_are_never_sampled_with_mixed_filters_in_one_batch():
    torch.manual_seed(9)
    vocab = 50
    row = torch.randn(vocab) * 2
    params = [SamplingParams(top_k=3), SamplingParams(top_p=0.5), SamplingParams(min_p=0.5), SamplingParams()] * 2000
    logits = row.expand(len(params), -1).contiguous()
    tokens = sample(logits, params).token_ids.view(-1, 4)
    probs = torch.softmax(row, -1)
    top3 = set(probs.topk(3).indices.tolist())
    assert set(tokens[:, 0].tolist()) <= top3
    nucleus = nucleus_reference(row, 1.0, 0.5).nonzero().flatten().tolist()
    assert set(tokens[:, 1].tolist()) <= set(nucleus)
    above = set((probs >= 0.5 * probs.max()).nonzero().flatten().tolist())
    assert set(tokens[:, 2].tolist()) <= above
    assert len(set(tokens[:, 3].tolist())) > len(above)


def test_empty_batch():
    out = sample(torch.empty(0, 10), [])
    assert out.token_ids.shape == (0,)


def test_exponential_race_has_no_nan_for_all_filtered_but_one():
    # Only one token survives; every other prob is 0, and 0 / q must never become NaN and win the argmax.
    logits = torch.full((DRAWS, 30), -math.inf)
    logits[:, 17] = 0.0
    logits[:, 3] = -100.0
    out = sample(logits, [SamplingParams(min_p=0.5)] * DRAWS)
    assert (out.token_ids == 17).all()


# --- counter-based random numbers: the splitmix64 finaliser (Vigna's splitmix64.c) ---


def _splitmix64_mix(z: int) -> int:
    """The reference finaliser, written from the published code."""
    mask = (1 << 64) - 1
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return z ^ (z >> 31)


def test_the_row_key_and_draws_are_splitmix64_of_seed_token_index_and_token_id():
    golden, mask = 0x9E3779B97F4A7C15, (1 << 64) - 1
    assert _splitmix64_mix(golden) == 0xE220A8397B1DCDAF  # splitmix64's first output from state 0
    for seed, index in [(0, 0), (1, 0), (0, 1), (42, 7), (-7, 3), (2**40 + 5, 1000), (2**64 + 9, 2)]:
        key = _splitmix64_mix((_splitmix64_mix((seed + golden) & mask) + index * golden) & mask)
        got = torch.tensor([row_key(seed, index)])
        assert row_key(seed, index) & mask == key, (seed, index)
        # The draw for token id t: the top 24 bits of mix(key + (t + 1) * golden) as a uniform in (0, 1].
        bits = [_splitmix64_mix((key + (t + 1) * golden) & mask) >> 40 for t in range(5)]
        expected = [-math.log((b + 1) / 2**24) for b in bits]
        assert exponentials(got, 5)[0].tolist() == pytest.approx(expected, rel=1e-6)
