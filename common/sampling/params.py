"""Per-request sampling parameters, with the names and defaults users know from vLLM."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from omnirun.errors import SamplingParamsError


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
    max_new_tokens None: generate until a stop rule or the context length (an explicit number that does not fit
    in the context with the prompt is an error). stop / stop_token_ids / ignore_eos are stored for the engine;
    `stop` is normalised to a list.
    """

    max_new_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    logprobs: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_new_tokens is not None and (not _is_int(self.max_new_tokens) or self.max_new_tokens < 1):
            raise _bad("max_new_tokens", self.max_new_tokens, "an int >= 1, or None for up to the context length")
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
        if not isinstance(self.ignore_eos, bool):
            raise _bad("ignore_eos", self.ignore_eos, "True or False")

        # Plain Python numbers from here on, so numpy scalars and ints-for-floats behave alike downstream.
        self.max_new_tokens = None if self.max_new_tokens is None else int(self.max_new_tokens)
        self.temperature = float(self.temperature)
        self.top_p = float(self.top_p)
        self.top_k = int(self.top_k)
        self.min_p = float(self.min_p)
        self.seed = None if self.seed is None else int(self.seed)
        self.logprobs = None if self.logprobs is None else int(self.logprobs)
        self.stop = self._normalise_stop(self.stop)
        self.stop_token_ids = self._normalise_stop_token_ids(self.stop_token_ids)

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

    @property
    def greedy(self) -> bool:
        """True when the request always takes the most likely token."""
        return self.temperature == 0 or self.top_k == 1
