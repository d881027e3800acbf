"""The checks a request passes before it is queued, from fixed facts of the model only.

Apart from the Engine so that a front without the engine in its process (the HTTP server over an engine process)
refuses a bad request with the same one-line ConfigError, before it is accepted.
"""

from __future__ import annotations

from collections.abc import Sequence

from omnirun.errors import ConfigError
from omnirun.sampling import SamplingParams


def check_request(
    prompt_ids: Sequence[int], params: SamplingParams, context_length: int, vocab_size: int, has_tokenizer: bool
) -> list[int]:
    """The prompt as a list of ints; ConfigError when the request cannot run on this model."""
    prompt_ids = [int(t) for t in prompt_ids]
    context, vocab = context_length, vocab_size
    if not prompt_ids:
        raise ConfigError("an empty prompt has no token to continue from: give at least one token")
    if len(prompt_ids) >= context:
        raise ConfigError(
            f"the prompt has {len(prompt_ids)} tokens, the context length is {context}: shorten the prompt "
            "or raise --context-length"
        )
    if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
        bad = min(prompt_ids) if min(prompt_ids) < 0 else max(prompt_ids)
        raise ConfigError(f"prompt token id {bad} is outside the model's vocabulary: use ids in [0, {vocab})")
    limit = params.max_new_tokens
    if limit is not None and len(prompt_ids) + limit > context:
        raise ConfigError(
            f"the prompt has {len(prompt_ids)} tokens and max_new_tokens is {limit}: together past the context "
            f"length {context}; use max_new_tokens <= {context - len(prompt_ids)}, or None to stop at the context "
            "length"
        )
    named = [*(params.logit_bias or ()), *params.stop_token_ids]
    if named and max(named) >= vocab:
        raise ConfigError(
            f"token id {max(named)} in logit_bias or stop_token_ids is outside the vocabulary [0, {vocab})"
        )
    if params.stop and not has_tokenizer:
        raise ConfigError("stop strings need a tokenizer: use stop_token_ids, or load a model with one")
    return prompt_ids
