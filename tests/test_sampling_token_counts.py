"""The engine's device-kept token counts (omnirun.sampling.token_counts) against counts made from the token lists."""

from __future__ import annotations

import torch

from omnirun.sampling import SamplingParams
from omnirun.sampling.adjust import apply_penalties
from omnirun.sampling.token_counts import TokenCounts

VOCAB = 12
PENALIZED = SamplingParams(frequency_penalty=1.0, repetition_penalty=2.0)
PLAIN = SamplingParams()


def _counts(tokens: list[int]) -> list[int]:
    return torch.bincount(torch.tensor(tokens, dtype=torch.int64), minlength=VOCAB).tolist()


def _view(kept: TokenCounts, owners, rows, params, prompts, outputs, pending=None, row_tokens=None):
    pending = pending or [0] * len(owners)
    return kept.view(owners, rows, params, prompts, outputs, pending, row_tokens, VOCAB)


def test_counts_follow_the_sampled_tokens_step_by_step(monkeypatch):
    kept = TokenCounts(max_rows=4, device="cpu")
    fills = []
    fill = kept._fill
    monkeypatch.setattr(kept, "_fill", lambda *args: fills.append(args[0]) or fill(*args))
    prompt, output = [1, 2, 2], []
    for token in [5, 5, 7, 1]:
        view = _view(kept, [10], [3], [PENALIZED], [prompt], [output])
        assert view.counts[view.rows[0]].tolist() == (_counts(output) if output else [0] * VOCAB)
        assert view.prompt_seen[3, [1, 2]].all() and view.prompt_seen[3].sum() == 2
        kept.add(view, torch.tensor([token]))
        output = output + [token]
    assert kept.counts[3].tolist() == _counts(output)
    assert fills == [[0]]  # filled from the lists once, then kept on the device


def test_a_row_taken_over_by_another_request_is_counted_afresh():
    kept = TokenCounts(max_rows=2, device="cpu")
    view = _view(kept, [1], [0], [PENALIZED], [[3]], [[4, 4, 5]])
    kept.add(view, torch.tensor([6]))
    view = _view(kept, [2], [0], [PENALIZED], [[8]], [[9]])  # request 2 now owns row 0
    assert kept.counts[0].tolist() == _counts([9])
    assert kept.prompt_seen[0].nonzero().flatten().tolist() == [8]


def test_a_row_that_missed_a_token_is_counted_afresh():
    """A step that viewed the counts but never added its token (it failed before sampling): the host's lists are
    the truth, and the next view rebuilds the row from them."""
    kept = TokenCounts(max_rows=2, device="cpu")
    view = _view(kept, [1], [1], [PENALIZED], [[3]], [[4]])
    kept.add(view, torch.tensor([6]))
    _view(kept, [1], [1], [PENALIZED], [[3]], [[4, 6]])  # no add: this step's token 8 reached the host only
    _view(kept, [1], [1], [PENALIZED], [[3]], [[4, 6, 8]])
    assert kept.counts[1].tolist() == _counts([4, 6, 8])


def test_a_pending_token_is_counted_from_the_device():
    kept = TokenCounts(max_rows=3, device="cpu")
    row_tokens = torch.tensor([0, 0, 9])
    _view(kept, [1], [2], [PENALIZED], [[3]], [[4]], pending=[1], row_tokens=row_tokens)
    assert kept.counts[2].tolist() == _counts([4, 9])


def test_rows_without_a_penalty_read_the_empty_scratch_row():
    kept = TokenCounts(max_rows=2, device="cpu")
    assert _view(kept, [1], [0], [PLAIN], [[3]], [[4]]) is None  # nobody penalized: nothing kept, nothing allocated
    assert kept.counts is None
    view = _view(kept, [1, 2], [0, 1], [PLAIN, PENALIZED], [[3], [5]], [[4], [6]])
    assert view.rows.tolist() == [kept.scratch, 1]
    kept.add(view, torch.tensor([4, 6]))
    assert kept.counts[kept.scratch].sum() == 0
    # and the penalties leave the plain row's logits as they are
    logits = torch.randn(2, VOCAB)
    repetition, frequency, presence = torch.tensor([1.0, 2.0]), torch.tensor([0.0, 1.0]), torch.tensor([0.0, 0.0])
    view = _view(kept, [1, 2], [0, 1], [PLAIN, PENALIZED], [[3], [5]], [[4, 4], [6, 6]])
    got = apply_penalties(logits, view.counts, view.prompt_seen, view.rows, repetition, frequency, presence)
    assert torch.equal(got[0], logits[0]) and not torch.equal(got[1], logits[1])
