"""Per-request sampling parameters, with the names and defaults users know from vLLM."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from omnirun.errors import SamplingParamsError
from omnirun.structured.spec import GrammarSpec


def _bad(field: str, value: object, valid: str) -> SamplingParamsError:
    return SamplingParamsError(f"SamplingParams.{field}={value!r} is invalid: use {valid}")


def _is_int(value: object) -> bool:
    # bool is an int subclass in Python; `top_k=True` is a mistake, not 1.
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    """How to pick the tokens of one request.

    The defaults are vLLM's: 16 new tokens, temperature 1.0 — a bare `SamplingParams()` *samples*; pass
    temperature=0 for greedy (the `omnirun generate` CLI is greedy unless --temperature is given).
    temperature 0 (or top_k 1) means greedy. top_k -1 or 0 turns top-k off, top_p 1 turns nucleus sampling off,
    min_p 0 turns min-p off. logprobs: None for none, 0 for the chosen token's logprob, n for also the top n.
    prompt_logprobs, the same for each prompt token after the first (computed in the prefill, which then reads no
    prefix from the prefix cache: every prompt token's logits are recomputed); max_new_tokens 0 then returns them
    with no new token.
    presence_penalty / frequency_penalty (OpenAI's, in [-2, 2]) subtract once / once per occurrence for every
    token already in the output; repetition_penalty (HF's and vLLM's, > 0, 1 off) divides the positive logits and
    multiplies the negative ones of every token in the prompt or the output; logit_bias adds to the logits of the
    token ids it names; min_tokens keeps EOS and stop_token_ids from being sampled before that many new tokens.
    skip_special_tokens (vLLM's, default True) leaves special tokens out of the text; False keeps them (a tool call
    parser that looks for one, as Mistral's [TOOL_CALLS]). max_new_tokens None: generate until a stop rule or the
    context length (an explicit number that does not fit in the context with the prompt is an error). stop /
    stop_token_ids / ignore_eos are stored for the engine; `stop` is normalised to a list.
    """

    max_new_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    # What the output must match (omnirun.structured: a JSON schema, any JSON object, a regex, a choice, an EBNF
    # grammar), enforced token by token by the engine's grammar backend; None: free text.
    structured_output: GrammarSpec | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens is not None and (not _is_int(self.max_new_tokens) or self.max_new_tokens < 0):
            raise _bad(
                "max_new_tokens", self.max_new_tokens, "an int >= 0 (0: the prompt only), or None for up to the context"
            )
        if not _is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise _bad("temperature", self.temperature, "a finite number >= 0 (0 means greedy)")
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise _bad("top_p", self.top_p, "a number in (0, 1] (1 turns top-p off)")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise _bad("top_k", self.top_k, "an int >= 1, or -1 or 0 to turn top-k off")
        if not _is_real(self.min_p) or not 0 <= self.min_p <= 1:
            raise _bad("min_p", self.min_p, "a number in [0, 1] (0 turns min-p off)")
        if self.seed is not None and not _is_int(self.seed):
            raise _bad("seed", self.seed, "an int, or None for an unseeded request")
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < 0):
            raise _bad("logprobs", self.logprobs, "an int >= 0 (0: chosen token only), or None for no logprobs")
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs) or self.prompt_logprobs < 0):
            raise _bad("prompt_logprobs", self.prompt_logprobs, "an int >= 0 (0: each prompt token's only), or None")
        if not isinstance(self.ignore_eos, bool):
            raise _bad("ignore_eos", self.ignore_eos, "True or False")
        if not isinstance(self.skip_special_tokens, bool):
            raise _bad("skip_special_tokens", self.skip_special_tokens, "True or False")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -2 <= value <= 2:
                raise _bad(name, value, "a number in [-2, 2] (0 turns it off)")
        if not _is_real(self.repetition_penalty) or not 0 < self.repetition_penalty < math.inf:
            raise _bad("repetition_penalty", self.repetition_penalty, "a finite number > 0 (1 turns it off)")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise _bad("min_tokens", self.min_tokens, "an int >= 0")
        if self.structured_output is not None and not isinstance(self.structured_output, GrammarSpec):
            raise _bad("structured_output", self.structured_output, "an omnirun.structured.GrammarSpec, or None")
        if self.max_new_tokens is not None and self.min_tokens > self.max_new_tokens:
            raise _bad("min_tokens", self.min_tokens, f"at most max_new_tokens ({self.max_new_tokens})")

        # Plain Python numbers from here on, so numpy scalars and ints-for-floats behave alike downstream.
        self.max_new_tokens = None if self.max_new_tokens is None else int(self.max_new_tokens)
        self.temperature = float(self.temperature)
        self.top_p = float(self.top_p)
        self.top_k = int(self.top_k)
        self.min_p = float(self.min_p)
        self.seed = None if self.seed is None else int(self.seed)
        self.logprobs = None if self.logprobs is None else int(self.logprobs)
        self.prompt_logprobs = None if self.prompt_logprobs is None else int(self.prompt_logprobs)
        self.stop = self._normalise_stop(self.stop)
        self.stop_token_ids = self._normalise_stop_token_ids(self.stop_token_ids)
        self.presence_penalty = float(self.presence_penalty)
        self.frequency_penalty = float(self.frequency_penalty)
        self.repetition_penalty = float(self.repetition_penalty)
        self.min_tokens = int(self.min_tokens)
        self.logit_bias = self._normalise_logit_bias(self.logit_bias)

    @staticmethod
    def _normalise_stop(stop: list[str] | str | None) -> list[str]:
        if stop is None:
            return []
        items = [stop] if isinstance(stop, str) else stop
        if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) and s for s in items):
            raise _bad("stop", stop, "a non-empty string or a list of non-empty strings")
        return list(items)

    @staticmethod
    def _normalise_stop_token_ids(ids: list[int] | None) -> list[int]:
        if ids is None:
            return []
        if not isinstance(ids, (list, tuple)) or not all(_is_int(i) and i >= 0 for i in ids):
            raise _bad("stop_token_ids", ids, "a list of token ids (ints >= 0)")
        return [int(i) for i in ids]

    @staticmethod
    def _normalise_logit_bias(bias: dict[int, float] | None) -> dict[int, float] | None:
        if bias is None or (isinstance(bias, dict) and not bias):
            return None
        valid = "a dict of token id (int >= 0) -> bias (a number in [-100, 100])"
        if not isinstance(bias, dict):
            raise _bad("logit_bias", bias, valid)
        for token, value in bias.items():
            if not _is_int(token) or token < 0 or not _is_real(value) or not -100 <= value <= 100:
                raise _bad("logit_bias", {token: value}, valid)
        return {int(t): float(v) for t, v in bias.items()}

    @property
    def penalized(self) -> bool:
        """True when the output (or prompt) so far changes the logits: presence, frequency or repetition penalty."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def adjusts_logits(self) -> bool:
        """True when the logits are changed before sampling: a penalty, a logit bias or min_tokens."""
        return self.penalized or self.logit_bias is not None or self.min_tokens > 0

    @property
    def greedy(self) -> bool:
        """True when the request always takes the most likely token."""
        return self.temperature == 0 or self.top_k == 1
