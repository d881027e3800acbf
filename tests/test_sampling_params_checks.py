"""SamplingParams checks: token id 0 is a valid stop token, booleans are not
numbers, and the max_new_tokens error says what to pass."""

from __future__ import annotations

import math

import pytest
import torch

from omnirun.errors import SamplingParamsError
from omnirun.sampling import Sampler, SamplingBatch, SamplingParams, TokenHistory, reference
from omnirun.sampling.adjust import LogitAdjustments


def test_token_id_zero_is_a_stop_token_and_negative_ids_are_not():
    assert SamplingParams(stop_token_ids=[0, 7]).stop_token_ids == [0, 7]
    with pytest.raises(SamplingParamsError, match=r"stop_token_ids=\[3, -1\] is invalid"):
        SamplingParams(stop_token_ids=[3, -1])


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "presence_penalty", "repetition_penalty"])
def test_a_boolean_is_not_a_number(field):
    with pytest.raises(SamplingParamsError, match=rf"^SamplingParams\.{field}=True is invalid"):
        SamplingParams(**{field: True})


def test_the_max_new_tokens_error_says_what_to_pass():
    with pytest.raises(SamplingParamsError) as excinfo:
        SamplingParams(max_new_tokens=-1)
    assert str(excinfo.value) == (
        "SamplingParams.max_new_tokens=-1 is invalid: use an int >= 0 (0: the prompt only), or None for up to the "
        "context"
    )


def test_penalties_without_a_token_history_are_refused_with_the_fix():
    with pytest.raises(SamplingParamsError) as excinfo:
        LogitAdjustments.build([SamplingParams(presence_penalty=1.0)], [0], None, 8, "cpu")
    assert str(excinfo.value) == (
        "presence/frequency/repetition penalties need each request's tokens: pass a TokenHistory"
    )


def test_min_tokens_and_logit_bias_need_no_token_history():
    params = [SamplingParams(min_tokens=2, stop_token_ids=[5], logit_bias={1: 3.0})]
    adjusted = LogitAdjustments.build(params, [0], None, 8, "cpu").apply(torch.zeros(1, 8))
    expected = torch.tensor([[0.0, 3.0, 0.0, 0.0, 0.0, float("-inf"), 0.0, 0.0]])
    assert torch.equal(adjusted, expected)


def test_a_pending_token_id_zero_is_counted():
    """Token 0 is a real token (pending -1 means none): a presence penalty of 1 lowers its logit by 1."""
    history = TokenHistory([[]], [[]], pending=torch.tensor([0]))
    adjustments = LogitAdjustments.build([SamplingParams(presence_penalty=1.0)], [1], history, 4, "cpu")
    assert adjustments.apply(torch.zeros(1, 4)).tolist() == [[-1.0, 0.0, 0.0, 0.0]]


def test_a_repetition_penalty_of_two_divides_and_multiplies_by_two():
    history = TokenHistory([[1, 2]], [[]])
    adjustments = LogitAdjustments.build([SamplingParams(repetition_penalty=2.0)], [0], history, 4, "cpu")
    got = adjustments.apply(torch.tensor([[4.0, 4.0, -4.0, 4.0]]))
    assert got.tolist() == [[4.0, 2.0, -8.0, 4.0]]  # tokens 1 and 2 were in the prompt


def test_adjusted_logits_are_a_new_float32_tensor():
    logits = torch.tensor([[1.0, 2.0, 3.0]], dtype=torch.bfloat16)
    adjustments = LogitAdjustments.build([SamplingParams(logit_bias={0: 1.0})], [0], None, 3, "cpu")
    got = adjustments.apply(logits)
    assert got.dtype == torch.float32 and got.tolist() == [[2.0, 2.0, 3.0]]
    assert logits.tolist() == [[1.0, 2.0, 3.0]]  # left as it was


def test_a_nucleus_cut_inside_tied_tokens_keeps_the_whole_tie():
    """A cut keeps every token equal to the last one the nucleus needs, so the filter does not depend on the order
    of equal values (and a sort-free kernel finds the same cut)."""
    logits = torch.zeros(1, 100)
    logits[0, ::3] = 10.0  # 34 tied tokens hold almost all the mass, 1/34 each
    logits[0, 1] = 10.5  # one token above them
    batch = SamplingBatch.build([SamplingParams(top_p=0.4)], [0], "cpu", vocab_size=100)
    kept = (reference.filtered_probs(logits, batch)[0] > 0).nonzero().flatten().tolist()
    # the nucleus needs the top token and some of the tie (0.4 is more than the top token's share): all 34 stay
    assert kept == sorted([1, *range(0, 100, 3)])


def _kept(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    batch = SamplingBatch.build(params, [0] * len(params), "cpu", vocab_size=logits.shape[-1])
    return reference.filtered_probs(logits, batch)


def test_the_nucleus_is_the_shortest_prefix_that_reaches_top_p():
    logits = torch.tensor([[0.5, 0.25, 0.125, 0.125]]).log()  # the two first reach 0.75 exactly
    probs = _kept(logits, [SamplingParams(top_p=0.75)])
    assert probs[0].tolist() == pytest.approx([2 / 3, 1 / 3, 0.0, 0.0])  # (the nucleus, renormalised)


def test_a_row_with_top_p_one_keeps_its_tail_when_the_cumsum_rounds_to_one():
    logits = torch.zeros(2, 10)
    logits[:, 0] = 20.0  # token 0 has all but 9 x 2e-9 of the mass: the running sum is 1.0 in float32 after it
    probs = _kept(logits, [SamplingParams(top_p=1.0), SamplingParams(top_p=0.9)])
    assert bool((probs[0] > 0).all())  # top-p off: nothing dropped
    assert probs[1, 1:].tolist() == [0.0] * 9  # the other row's nucleus is token 0 alone


def test_min_p_keeps_tokens_exactly_at_the_threshold():
    # uniform: every token has p_max; min_p 1 keeps tokens with p >= 1 x p_max, i.e. all of them
    assert _kept(torch.zeros(1, 4), [SamplingParams(min_p=1.0)]).tolist() == [[0.25] * 4]


def test_a_tiny_temperature_does_not_overflow_in_any_row():
    """Each row's own maximum is subtracted before dividing by the temperature, so that nothing reaches inf."""
    logits = torch.tensor([[1.0, 0.0], [1000.0, 999.0]])
    probs = _kept(logits, [SamplingParams(temperature=1e-37)] * 2)
    assert probs.tolist() == [[1.0, 0.0], [1.0, 0.0]]


def test_batch_build_errors_say_what_to_pass():
    with pytest.raises(SamplingParamsError) as excinfo:
        SamplingBatch.build([SamplingParams(), SamplingParams()], [0], "cpu")
    assert str(excinfo.value) == (
        "SamplingBatch.build got 2 params but 1 token indices: pass one token index per request"
    )
    with pytest.raises(SamplingParamsError) as excinfo:
        SamplingBatch.build([SamplingParams(min_tokens=1)], [0], "cpu")
    assert str(excinfo.value) == "penalties, logit_bias and min_tokens need SamplingBatch.build(vocab_size=)"


def test_asking_for_the_chosen_logprob_only_still_gives_the_tokens():
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0]])
    out = Sampler()(logits, SamplingBatch.build([SamplingParams(temperature=0, logprobs=0)] * 2, [0, 0], "cpu"))
    assert out.token_ids.tolist() == [1, 0]
    assert torch.allclose(out.logprobs, torch.log_softmax(logits, dim=-1)[[0, 1], [1, 0]])
    assert out.top_logprob_ids is None and out.top_logprobs is None


def test_logit_bias_accepts_token_zero_and_names_a_bad_entry():
    assert SamplingParams(logit_bias={0: -1}).logit_bias == {0: -1.0}
    with pytest.raises(SamplingParamsError) as excinfo:
        SamplingParams(logit_bias={3: 1.0, -1: 2.0})
    assert str(excinfo.value) == (
        "SamplingParams.logit_bias={-1: 2.0} is invalid: use a dict of token id (int >= 0) -> bias (a number in "
        "[-100, 100])"
    )
    with pytest.raises(SamplingParamsError, match=r"^SamplingParams\.logit_bias=\[1\] is invalid: use a dict of"):
        SamplingParams(logit_bias=[1])


def test_a_batch_lives_on_the_device_asked_for_in_its_dtypes():
    """On the meta device (any host), so that a tensor left on the default device shows."""
    params = [
        SamplingParams(
            temperature=0.5,
            top_k=3,
            top_p=0.9,
            min_p=0.1,
            presence_penalty=1.0,
            repetition_penalty=1.2,
            logit_bias={1: 2.0},
            min_tokens=4,
            stop_token_ids=[5],
        )
    ]
    history = TokenHistory([[1]], [[2]])
    batch = SamplingBatch.build(params, [1], "meta", vocab_size=8, history=history)
    for name, dtype in [
        ("temperatures", torch.float32),
        ("top_ps", torch.float32),
        ("top_ks", torch.int64),
        ("min_ps", torch.float32),
        ("greedy", torch.bool),
    ]:
        tensor = getattr(batch, name)
        assert tensor.device.type == "meta" and tensor.dtype == dtype, name
    adjustments = batch.adjustments
    tensors = [adjustments.counts, adjustments.prompt_seen, adjustments.repetition, adjustments.frequency]
    tensors += [adjustments.presence, *adjustments.bias, *adjustments.banned]
    assert [t.device.type for t in tensors] == ["meta"] * len(tensors)


def test_min_tokens_skips_stop_ids_outside_the_vocabulary():
    """An EOS id the tokenizer has but the logits do not (vocab 8, id 8) is not banned, and is no error."""
    history = TokenHistory([[]], [[]], eos_token_ids=[8])
    adjustments = LogitAdjustments.build([SamplingParams(min_tokens=2, stop_token_ids=[3])], [0], history, 8, "cpu")
    expected = [0.0] * 8
    expected[3] = float("-inf")
    assert adjustments.apply(torch.zeros(1, 8)).tolist() == [expected]


@pytest.mark.parametrize(
    ("field", "value", "valid"),
    [
        ("temperature", -1.0, "a finite number >= 0 (0 means greedy)"),
        ("top_p", 0.0, "a number in (0, 1] (1 turns top-p off)"),
        ("top_k", -2, "an int >= 1, or -1 or 0 to turn top-k off"),
        ("min_p", 2.0, "a number in [0, 1] (0 turns min-p off)"),
        ("seed", 1.5, "an int, or None for an unseeded request"),
        ("logprobs", -1, "an int >= 0 (0: chosen token only), or None for no logprobs"),
        ("ignore_eos", 1, "True or False"),
        ("stop", [""], "a non-empty string or a list of non-empty strings"),
        ("stop_token_ids", [-1], "a list of token ids (ints >= 0)"),
    ],
)
def test_each_refusal_says_exactly_what_to_use(field, value, valid):
    with pytest.raises(SamplingParamsError) as excinfo:
        SamplingParams(**{field: value})
    assert str(excinfo.value) == f"SamplingParams.{field}={value!r} is invalid: use {valid}"


@pytest.mark.parametrize(
    ("field", "value", "valid"),
    [
        ("presence_penalty", -2.5, "a number in [-2, 2] (0 turns it off)"),
        ("frequency_penalty", 2.5, "a number in [-2, 2] (0 turns it off)"),
        ("repetition_penalty", math.inf, "a finite number > 0 (1 turns it off)"),
        ("repetition_penalty", 0.0, "a finite number > 0 (1 turns it off)"),
        ("min_tokens", -1, "an int >= 0"),
        ("logit_bias", {1: -100.5}, "a dict of token id (int >= 0) -> bias (a number in [-100, 100])"),
    ],
)
def test_penalty_refusals_say_exactly_what_to_use(field, value, valid):
    with pytest.raises(SamplingParamsError) as excinfo:
        SamplingParams(**{field: value})
    assert str(excinfo.value) == f"SamplingParams.{field}={value!r} is invalid: use {valid}"


def test_penalty_ranges_include_their_ends():
    SamplingParams(presence_penalty=-2, frequency_penalty=2, logit_bias={1: -100, 2: 100})
    assert SamplingParams(max_new_tokens=3, min_tokens=3).min_tokens == 3
    with pytest.raises(SamplingParamsError) as excinfo:
        SamplingParams(max_new_tokens=3, min_tokens=4)
    assert str(excinfo.value) == "SamplingParams.min_tokens=4 is invalid: use at most max_new_tokens (3)"
