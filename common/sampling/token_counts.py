"""The penalties' token counts of each request, kept on the device from step to step.

Counting every penalized request's output (and marking its prompt) from the host's token lists at each step costs
host time in proportion to the batch's tokens: at 256 requests a few hundred tokens long, milliseconds a step,
spent before the step's sampling can launch. vLLM and SGLang keep such counts on the device instead. So does this:
a request's row is filled from the host's lists once, the first time the request samples in that row, and each
sampled token is then added on the device, where it already is.

Rows are those of the request pool (a batch's `req_pool_indices`). The tensors are allocated at the first penalized
request: counts [rows + 1, V] int32, and prompt marks [rows + 1, V] bool at the first repetition penalty. The last
row is scratch: the batch rows without a penalty read and write it, harmlessly (their penalties are 1, 0, 0).

A row is refilled whenever what it holds is not the request's tokens as the host counts them: another request's, or
another number of tokens (a step that viewed the counts and never added its token).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from omnirun.host_to_device import to_device
from omnirun.sampling.adjust import KeptCounts, put
from omnirun.sampling.params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class _Filled:
    owner: int  # the request whose tokens the row holds
    tokens: int  # how many output tokens it counts
    prompt: bool  # whether its prompt marks are set


class TokenCounts:
    def __init__(self, max_rows: int, device: torch.device | str):
        self.scratch = max_rows
        self.device = device
        self.counts: torch.Tensor | None = None
        self.prompt_seen: torch.Tensor | None = None
        self._filled: list[_Filled | None] = [None] * max_rows
        self._viewed: list[int] = []  # the rows of the last view: add() counts one more token in each

    def view(
        self,
        owners: Sequence[int],
        rows: Sequence[int],
        params: Sequence[SamplingParams],
        prompt_ids: Sequence[Sequence[int]],
        output_ids: Sequence[Sequence[int]],
        pending: Sequence[int],
        row_tokens: torch.Tensor | None,
        vocab_size: int,
    ) -> KeptCounts | None:
        """The counts a batch's penalties read (None when no request of it has a penalty), after filling the rows
        that do not hold their request's tokens. owners[i]: request i's id; rows[i]: its request-pool row; its
        tokens: output_ids[i] and pending[i] more that only the device has (with overlap scheduling at most one,
        the newest, at row_tokens[rows[i]])."""
        penalized = [i for i, p in enumerate(params) if p.penalized]
        if not penalized:
            return None
        with_prompt = [params[i].repetition_penalty != 1 for i in penalized]
        self._allocate(vocab_size, any(with_prompt))
        stale = []
        for i, prompt in zip(penalized, with_prompt, strict=True):
            filled = self._filled[rows[i]]
            tokens = len(output_ids[i]) + pending[i]
            if filled is None or (filled.owner, filled.tokens) != (owners[i], tokens) or prompt > filled.prompt:
                stale.append(i)
                self._filled[rows[i]] = _Filled(owners[i], tokens, prompt)
        if stale:
            self._fill(stale, rows, params, prompt_ids, output_ids, pending, row_tokens)
        self._viewed = [rows[i] for i in penalized]
        batch_rows = [self.scratch] * len(params)
        for i in penalized:
            batch_rows[i] = rows[i]
        prompt_seen = self.prompt_seen if any(with_prompt) else None
        return KeptCounts(self.counts, prompt_seen, to_device(batch_rows, torch.int64, self.device))

    def add(self, kept: KeptCounts, token_ids: torch.Tensor) -> None:
        """Count each batch row's sampled token: on the device, without a sync."""
        ones = torch.ones_like(kept.rows, dtype=torch.int32)
        kept.counts.index_put_((kept.rows, token_ids), ones, accumulate=True)
        kept.counts[self.scratch].zero_()  # every unpenalized row's token lands there: keep it from growing
        for row in self._viewed:
            self._filled[row].tokens += 1
        self._viewed = []

    def _allocate(self, vocab_size: int, with_prompt: bool) -> None:
        shape = (self.scratch + 1, vocab_size)
        if self.counts is None:
            self.counts = torch.zeros(shape, dtype=torch.int32, device=self.device)
            mib = self.counts.nbytes / 2**20
            logger.info("penalties: token counts of %d request rows kept on the device (%.0f MiB)", shape[0], mib)
        if with_prompt and self.prompt_seen is None:
            self.prompt_seen = torch.zeros(shape, dtype=torch.bool, device=self.device)

    def _fill(
        self,
        stale: list[int],
        rows: Sequence[int],
        params: Sequence[SamplingParams],
        prompt_ids: Sequence[Sequence[int]],
        output_ids: Sequence[Sequence[int]],
        pending: Sequence[int],
        row_tokens: torch.Tensor | None,
    ) -> None:
        """Count the stale rows' requests afresh from the host's lists (and the device's pending tokens)."""
        at = [rows[i] for i in stale]
        self.counts.index_fill_(0, to_device(at, torch.int64, self.device), 0)
        put(self.counts, at, [output_ids[i] for i in stale], 1, self.device, accumulate=True)
        waiting = [rows[i] for i in stale if pending[i]]
        if waiting:
            index = to_device(waiting, torch.int64, self.device)
            ones = torch.ones_like(index, dtype=torch.int32)
            self.counts.index_put_((index, row_tokens[index]), ones, accumulate=True)
        repeated = [i for i in stale if params[i].repetition_penalty != 1]
        if repeated:
            marked = [rows[i] for i in repeated]
            self.prompt_seen.index_fill_(0, to_device(marked, torch.int64, self.device), False)
            put(self.prompt_seen, marked, [prompt_ids[i] for i in repeated], True, self.device)
