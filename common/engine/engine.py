"""The engine loop: schedule a step, run it on the runner, sample, and apply stop rules."""

from __future__ import annotations

import collections
import itertools
import time
from collections.abc import Sequence
from typing import Any

from omnirun.batch import ForwardMode
from omnirun.engine.request import FinishReason, Request
from omnirun.engine.scheduler import ScheduledStep, Scheduler
from omnirun.errors import ConfigError
from omnirun.runner import ModelRunner
from omnirun.sampling import SamplingParams

# Tokens one prefill step may compute, and the largest piece of one prompt per step, when not configured.
DEFAULT_MAX_PREFILL_TOKENS = 8192


class Engine:
    def __init__(
        self,
        runner: ModelRunner,
        *,
        tokenizer: Any | None = None,
        eos_token_ids: Sequence[int] = (),
        max_prefill_tokens: int | None = None,
        chunked_prefill_size: int | None = None,
    ):
        self.runner = runner
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        max_prefill = max_prefill_tokens or DEFAULT_MAX_PREFILL_TOKENS
        self.scheduler = Scheduler(
            runner.kv,
            runner.device,
            max_running_requests=runner.kv.req_to_token.max_requests,
            max_prefill_tokens=max_prefill,
            chunked_prefill_size=min(chunked_prefill_size or max_prefill, max_prefill),
        )
        self._ids = itertools.count()
        # The latest decode steps' (seconds, batch size, tokens in the KV cache read), for `omnirun bench`; bounded so
        # that a long-lived engine does not grow without end.
        self.decode_steps: collections.deque[tuple[float, int, int]] = collections.deque(maxlen=100_000)

    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams) -> Request:
        prompt_ids = [int(t) for t in prompt_ids]
        context = self.runner.context_length
        vocab = self.runner.shape.vocab_size
        if not prompt_ids:
            raise ConfigError("an empty prompt has no token to continue from: give at least one token")
        if len(prompt_ids) >= context:
            raise ConfigError(
                f"the prompt has {len(prompt_ids)} tokens, the context length is {context}: shorten the prompt "
                "or raise --context-length"
            )
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise ConfigError(f"prompt token ids must be in [0, {vocab}): the model's vocabulary")
        if params.stop and self.tokenizer is None:
            raise ConfigError("stop strings need a tokenizer: use stop_token_ids, or load a model with one")
        request = Request(next(self._ids), prompt_ids, params, arrival_time=time.perf_counter())
        self.scheduler.add(request)
        return request

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def step(self) -> list[Request]:
        """Run one forward pass; returns the requests that received a token (finished ones included)."""
        step = self.scheduler.schedule()
        if step is None:
            return []
        start = time.perf_counter()
        logits = self.runner.forward(step.batch)
        updated = self._sample_and_append(step, logits)
        if step.batch.mode is ForwardMode.DECODE:
            self.decode_steps.append(
                (time.perf_counter() - start, step.batch.batch_size, int(step.batch.seq_lens_cpu.sum()))
            )
        return updated

    def _sample_and_append(self, step: ScheduledStep, logits) -> list[Request]:
        if not step.sampling:
            return []
        requests = [step.requests[i] for i in step.sampling]
        if len(step.sampling) != logits.shape[0]:
            logits = logits[step.sampling]
        params = [r.params for r in requests]
        out = self.runner.sample(logits, params, [len(r.output_ids) for r in requests])
        tokens = out.token_ids.tolist()
        logprobs = out.logprobs.tolist() if out.logprobs is not None else None
        top_ids = out.top_logprob_ids.tolist() if out.top_logprob_ids is not None else None
        top_values = out.top_logprobs.tolist() if out.top_logprobs is not None else None
        now = time.perf_counter()
        for i, (req, token) in enumerate(zip(requests, tokens, strict=True)):
            req.output_ids.append(token)
            if req.first_token_time is None:
                req.first_token_time = now
            n_top = req.params.logprobs
            if n_top is not None:
                req.logprobs.append(logprobs[i])
                if n_top:
                    req.top_logprobs.append(list(zip(top_ids[i][:n_top], top_values[i][:n_top], strict=True)))
            self._check_stop(req, token)
            if req.finished:
                req.finish_time = now
                self.scheduler.finish(req)
        return requests

    def _check_stop(self, req: Request, token: int) -> None:
        params = req.params
        if (token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
            req.finish_reason = FinishReason.STOP
        elif params.stop and self._cut_at_stop_string(req):
            req.finish_reason = FinishReason.STOP
        elif len(req.output_ids) >= params.max_new_tokens or req.num_tokens >= self.runner.context_length:
            req.finish_reason = FinishReason.LENGTH

    def _cut_at_stop_string(self, req: Request) -> bool:
        """Whether the text now contains a stop string; if so the text is cut before it (as vLLM does)."""
        text = self.decode(req.output_ids)
        hits = [i for i in (text.find(s) for s in req.params.stop) if i >= 0]
        if not hits:
            return False
        req.text = text[: min(hits)]
        return True

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def text_of(self, req: Request) -> str | None:
        """The output text: cut at the stop string where one ended it."""
        if self.tokenizer is None:
            return None
        if req.finished and req.params.stop and req.finish_reason is FinishReason.STOP and req.text:
            return req.text
        return self.decode(req.output_ids)
