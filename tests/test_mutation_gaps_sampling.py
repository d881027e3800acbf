"""SamplingParams checks the mutation run found unpinned: token id 0 is a valid stop token, booleans are not
numbers, and the max_new_tokens error says what to pass."""

from __future__ import annotations

import pytest

from omnirun.errors import SamplingParamsError
from omnirun.sampling import SamplingParams


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
        SamplingParams(max_new_tokens=0)
    assert str(excinfo.value) == (
        "SamplingParams.max_new_tokens=0 is invalid: use an int >= 1, or None for up to the context length"
    )
