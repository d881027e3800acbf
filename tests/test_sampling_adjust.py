"""Penalties, logit_bias and min_tokens in the batched sampler, each against a plain per-row torch reference."""

from __future__ import annotations

import pytest
import torch

from omnirun.errors import SamplingParamsError
from omnirun.sampling import Sampler, SamplingBatch, SamplingParams, TokenHistory

VOCAB = 50
EOS = 7


def _reference(logits: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    """One row, written the obvious way: vLLM's order (repetition, frequency/presence, bias, min_tokens)."""
    x = logits.clone().float()
    if p.repetition_penalty != 1:
        for t in set(prompt) | set(output):
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(output):
        x[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    if len(output) < p.min_tokens:
        for t in {EOS, *p.stop_token_ids}:
            x[t] = float("-inf")
    return x


def _batch(params, prompts, outputs, pending=None):
    history = TokenHistory(prompts, outputs, pending=pending, eos_token_ids=[EOS])
    # token_index counts the pending token too, as the engine's does
    index = [len(o) + (0 if pending is None or pending[i] < 0 else 1) for i, o in enumerate(outputs)]
    return SamplingBatch.build(params, index, "cpu", vocab_size=VOCAB, history=history)


CASES = [
    SamplingParams(temperature=0, presence_penalty=1.5),
    SamplingParams(temperature=0, frequency_penalty=0.7),
    SamplingParams(temperature=0, frequency_penalty=-0.5, presence_penalty=-1.0),
    SamplingParams(temperature=0, repetition_penalty=1.8),
    SamplingParams(temperature=0, repetition_penalty=0.6),
    SamplingParams(temperature=0, logit_bias={3: 100.0, 11: -5.5}),
    SamplingParams(temperature=0, min_tokens=9, stop_token_ids=[12]),
    SamplingParams(temperature=0),  # a plain row in the same batch is left alone
    SamplingParams(temperature=0, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2),
]


def test_adjusted_logits_equal_the_reference_row_by_row():
    torch.manual_seed(0)
    logits = torch.randn(len(CASES), VOCAB) * 3
    logits[:, EOS] = 20.0  # EOS would win everywhere unless held back
    prompts = [torch.randint(0, VOCAB, (6,)).tolist() for _ in CASES]
    outputs = [torch.randint(0, VOCAB, (5,)).tolist() + [EOS, 12, 12] for _ in CASES]
    batch = _batch(CASES, prompts, outputs)
    got = batch.adjustments.apply(logits)
    for i, p in enumerate(CASES):
        expected = _reference(logits[i], p, prompts[i], outputs[i])
        torch.testing.assert_close(got[i], expected, msg=f"row {i}: {p}")
    # Greedy sampling takes the argmax of the adjusted logits; logprobs stay those of the raw logits.
    out = Sampler()(logits, batch)
    assert out.token_ids.tolist() == got.argmax(-1).tolist()
    assert not torch.equal(got, logits.float())


def test_a_token_still_on_the_device_is_counted():
    p = SamplingParams(temperature=0, frequency_penalty=2.0, min_tokens=3)
    logits = torch.zeros(2, VOCAB)
    pending = torch.tensor([4, -1])
    batch = _batch([p, p], [[1], [1]], [[4], [4]], pending=pending)
    got = batch.adjustments.apply(logits)
    assert got[0, 4] == -4.0 and got[1, 4] == -2.0  # row 0 has token 4 twice: once on the host, once pending
    assert got[0, EOS] == float("-inf") and got[1, EOS] == float("-inf")  # 2 and 1 tokens < min_tokens 3


def test_min_tokens_releases_eos_once_reached():
    p = SamplingParams(temperature=0, min_tokens=2)
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS] = 5.0
    assert Sampler()(logits, _batch([p], [[1]], [[2]])).token_ids.item() != EOS
    assert Sampler()(logits, _batch([p], [[1]], [[2, 3]])).token_ids.item() == EOS


def test_sampled_rows_use_the_adjusted_logits():
    # A bias of -100 removes a token from sampling; +100 makes it (almost) certain.
    p = SamplingParams(temperature=1.0, seed=1, logit_bias={5: 100.0})
    logits = torch.zeros(4, VOCAB)
    out = Sampler()(logits, _batch([p] * 4, [[1]] * 4, [[]] * 4))
    assert out.token_ids.tolist() == [5, 5, 5, 5]


def test_no_adjustment_tensors_when_no_request_asks():
    batch = SamplingBatch.build([SamplingParams(temperature=0.5)], [0], "cpu", vocab_size=VOCAB)
    assert batch.adjustments is None


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {3: 101}}, "logit_bias"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 20, "max_new_tokens": 10}, "min_tokens"),
    ],
)
def test_bad_values_are_one_line_errors(kwargs, field):
    with pytest.raises(SamplingParamsError, match=f"SamplingParams.{field}=") as info:
        SamplingParams(**kwargs)
    assert "\n" not in str(info.value)


def test_penalties_without_history_are_refused():
    with pytest.raises(SamplingParamsError, match="TokenHistory"):
        SamplingBatch.build([SamplingParams(presence_penalty=1.0)], [0], "cpu", vocab_size=VOCAB)


# --- through the engine: the tokens a request gets are the reference's, with overlap scheduling and without ---


@pytest.fixture(scope="module")
def runner():
    from omnirun.assets.default_model import default_model_dir
    from omnirun.registry import get_platform
    from omnirun.testing import make_runner

    # The embedded model's weights are files (dummy weights may change with how they are drawn).
    return make_runner(get_platform("cpu"), default_model_dir())


def _teacher_forced_logits(runner, prompt: list[int], output: list[int]) -> torch.Tensor:
    """The model's logits before each output token, from one prefill of prompt + output."""
    from omnirun.batch import build_batch

    row = runner.kv.new_request()
    try:
        ids = prompt + output[:-1]
        batch = build_batch(runner.kv, [row], [0], [ids], runner.device, return_full_logits=True)
        return runner.forward(batch)[len(prompt) - 1 :].float()
    finally:
        runner.kv.release(row)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_engine_tokens_follow_the_adjusted_logits(runner, overlap):
    from omnirun.engine import Engine

    engine = Engine(runner, eos_token_ids=[EOS], overlap_schedule=overlap)
    prompt = [54, 261, 370, 414]  # "The model runner": greedily the model repeats 340 ten times
    cases = [
        SamplingParams(temperature=0, max_new_tokens=10, frequency_penalty=0.3),
        SamplingParams(temperature=0, max_new_tokens=10, presence_penalty=0.5),
        SamplingParams(temperature=0, max_new_tokens=10, repetition_penalty=2.0),
        SamplingParams(temperature=0, max_new_tokens=10, logit_bias={9: 1.5, 340: -100.0}),
        SamplingParams(temperature=0, max_new_tokens=10, logit_bias={EOS: 50.0}, min_tokens=5),
        SamplingParams(temperature=0, max_new_tokens=10),
    ]
    requests = [engine.add_request(prompt, p) for p in cases]
    while engine.has_work:
        engine.step()
    plain = requests[-1].output_ids
    assert plain == [340] * 10
    for req, p in zip(requests, cases, strict=True):
        logits = _teacher_forced_logits(runner, prompt, req.output_ids)
        for t, token in enumerate(req.output_ids):
            expected = _reference(logits[t], p, prompt, req.output_ids[:t]).argmax().item()
            assert token == expected, f"{p}: token {t}"
        if p is not cases[-1]:
            assert req.output_ids != plain, f"{p} changed nothing: the test would not see it ignored"
    # min_tokens held EOS back for 5 tokens, then the bias made it the 6th
    held = requests[4]
    assert len(held.output_ids) == 6 and held.output_ids[-1] == EOS and held.finish_reason.value == "stop"
