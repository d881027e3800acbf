"""The engine loop: schedule a step, run it on the runner, sample, and apply stop rules.

With overlap scheduling (the default where the platform queues kernels asynchronously) a step is *launched* —
forward pass and sampling queued on the device, its tokens copied to the host without waiting — and the previous
step is *completed* while it runs: its tokens read, stop rules applied, the next step scheduled. The host's work
then hides behind the device's. The next decode step reads each request's newest token where the sampler left it
on the device; a request that turns out to have stopped gets one extra step whose token is dropped.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import time
from collections.abc import Sequence
from typing import Any

import torch

from omnirun.batch import ForwardMode
from omnirun.engine.detokenizer import IncrementalDetokenizer
from omnirun.engine.prompt_logprobs import PromptLogprobs, logit_rows, prompt_logprobs
from omnirun.engine.request import FinishReason, Request
from omnirun.engine.request_checks import check_request
from omnirun.engine.scheduler import PENDING_TOKEN, ScheduledStep, Scheduler
from omnirun.memory.radix_cache import RadixCache
from omnirun.runner import ModelRunner
from omnirun.sampling import SampleOutput, SamplingParams, TokenHistory
from omnirun.sampling.token_bitmask import allocate_token_bitmask
from omnirun.sampling.token_counts import TokenCounts
from omnirun.structured import LazyGrammarBackend, StructuredOutputError

# Tokens one prefill step may compute, and the largest piece of one prompt per step, when not configured.
DEFAULT_MAX_PREFILL_TOKENS = 8192


@dataclasses.dataclass
class _Forwarded:
    """A step whose forward pass is queued and whose sampling is not (unless the decode graph sampled it)."""

    step: ScheduledStep
    requests: list[Request]  # those that sample, in logits-row order
    params: list[SamplingParams]
    token_index: list[int]
    history: TokenHistory | None
    logits: torch.Tensor | None = None  # the sampling rows' logits
    sampled: SampleOutput | None = None  # sampled inside the decode graph
    prompt_logprobs: list[PromptLogprobs] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Launched:
    """A step queued on the device; its sampled tokens arrive in host memory once `done` has been reached."""

    step: ScheduledStep
    requests: list[Request]  # those that sample, in logits-row order
    token_ids: torch.Tensor | None  # host tensors, filled by non-blocking copies
    logprobs: torch.Tensor | None
    top_logprob_ids: torch.Tensor | None
    top_logprobs: torch.Tensor | None
    done: Any  # a platform event recorded after the copies
    prompt_logprobs: list[PromptLogprobs] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class KVUsage:
    """The KV pool's pages: how many exist, how many are free, which live request holds how many, and how many only
    the prefix cache keeps (evicted when new tokens need them)."""

    page_size: int
    pages_total: int
    pages_free: int
    pages_held: dict[int, int]  # request id -> pages (a page shared by several requests counts for each)
    rows_free: int
    rows_total: int
    pages_cached: int = 0  # in the prefix cache and used by no live request
    pages_in_use: int | None = None  # distinct pages live requests hold (None: no sharing, sum of pages_held)

    @property
    def pages_leaked(self) -> int:
        """Pages neither free, nor held by a live request, nor kept by the prefix cache: always 0 unless something
        is broken."""
        in_use = sum(self.pages_held.values()) if self.pages_in_use is None else self.pages_in_use
        return self.pages_total - self.pages_free - self.pages_cached - in_use


@dataclasses.dataclass(frozen=True)
class PrefillStats:
    """Prompt tokens over every admission (a preempted request's recompute counts again): computed, or found in
    the prefix cache."""

    computed_tokens: int
    cached_tokens: int

    @property
    def hit_rate(self) -> float:
        total = self.computed_tokens + self.cached_tokens
        return self.cached_tokens / total if total else 0.0


class Engine:
    def __init__(
        self,
        runner: ModelRunner,
        *,
        tokenizer: Any | None = None,
        eos_token_ids: Sequence[int] = (),
        max_prefill_tokens: int | None = None,
        chunked_prefill_size: int | None = None,
        overlap_schedule: bool | None = None,
        prefix_caching: bool = True,
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
            context_length=runner.context_length,
        )
        # Requests share the K/V pages of prefixes computed before (a cache an earlier engine left is flushed).
        self.prefix_cache = RadixCache(runner.kv) if prefix_caching else None
        runner.kv.attach_cache(self.prefix_cache)
        # By default overlap only where kernels run asynchronously: on a synchronous device it hides nothing and
        # costs a dropped step per stopped request.
        self.overlap = runner.capabilities.async_execution if overlap_schedule is None else overlap_schedule
        # Each request row's newest sampled token, on the device: what the next decode step feeds (overlap only).
        self._row_tokens = (
            torch.zeros(runner.kv.req_to_token.max_requests, dtype=torch.int64, device=runner.device)
            if self.overlap
            else None
        )
        # The penalties' token counts of each request row, kept on the device (allocated at the first penalty).
        self._token_counts = TokenCounts(runner.kv.req_to_token.max_requests, runner.device)
        self._in_flight: _Launched | None = None
        self._ids = itertools.count()
        # Every request added and not yet finished, by id (what abort() looks up).
        self.requests: dict[int, Request] = {}
        # The latest decode steps' (seconds, batch size, tokens in the KV cache read), for `omnirun bench`: a step's
        # time is from the previous step's completion to its own; bounded so a long-lived engine does not grow.
        self.decode_steps: collections.deque[tuple[float, int, int]] = collections.deque(maxlen=100_000)
        self._last_completion: tuple[float, ForwardMode] | None = None
        # Structured output's constraints, compiled and tracked over this tokenizer.
        self.grammars = LazyGrammarBackend(tokenizer, runner.shape.vocab_size, sorted(self.eos_token_ids))

    def make_request(self, prompt_ids: Sequence[int], params: SamplingParams, *, detokenize: bool = False) -> Request:
        """A checked request, not yet queued (safe from any thread: it reads only fixed facts of the model).

        `detokenize` keeps its text step by step (for streams); requests with stop strings always do.
        """
        prompt_ids = check_request(
            prompt_ids, params, self.runner.context_length, self.runner.shape.vocab_size, self.tokenizer is not None
        )
        detokenizer = None
        if self.tokenizer is not None and (detokenize or params.stop):
            detokenizer = IncrementalDetokenizer(
                self.tokenizer, params.stop, skip_special_tokens=params.skip_special_tokens
            )
        arrival = time.perf_counter()
        request = Request(next(self._ids), prompt_ids, params, detokenizer=detokenizer, arrival_time=arrival)
        if params.structured_output is not None:  # compiled here, in the caller's thread, not in the engine loop
            request.grammar = self.grammars.matcher(params.structured_output)
        return request

    def add(self, request: Request) -> None:
        """Queue a request made by `make_request` (or one sent by an engine process's parent, whose grammar is
        compiled here)."""
        if request.params.structured_output is not None and request.grammar is None:
            request.grammar = self.grammars.matcher(request.params.structured_output)
        self.requests[request.request_id] = request
        self.scheduler.add(request)

    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams, *, detokenize: bool = False) -> Request:
        request = self.make_request(prompt_ids, params, detokenize=detokenize)
        self.add(request)
        return request

    def abort(self, request_id: int) -> Request | None:
        """End a request now (finish reason "abort") and free its pages; None if it is not live (finished or
        unknown). A step in flight that computed a token for it has that token dropped."""
        request = self.requests.get(request_id)
        if request is not None:
            self._finish(request, FinishReason.ABORT)
        return request

    def fail_all(self) -> list[Request]:
        """After a step raised: end every live request (finish reason "abort") and free the whole KV pool, so that
        the engine takes new requests again. Returns the requests that were ended."""
        failed = list(self.requests.values())
        self._in_flight = None
        try:
            self.runner.platform.synchronize()  # let whatever the failed step queued finish before pages are reused
        except Exception:  # the device may be what failed; the host state is reset all the same
            pass
        now = time.perf_counter()
        for request in failed:
            request.finish_reason, request.finish_time = FinishReason.ABORT, now
            request.num_pending, request.row = 0, None
        self.requests.clear()
        self.scheduler.clear()
        self.runner.kv.release_all()
        return failed

    def complete_in_flight(self) -> list[Request]:
        """Wait for the step in flight, if any, and take its tokens; afterwards the device runs nothing of ours."""
        previous, self._in_flight = self._in_flight, None
        return self._complete(previous)

    def recompute_all(self) -> None:
        """Make every running request recompute its KV cache (after a weight update the cache is stale)."""
        assert self._in_flight is None, "complete the step in flight first"
        for request in reversed(self.scheduler.running):  # preempt() queues first: keep their order
            self.scheduler.preempt(request, keep_cache=False)
        if self.prefix_cache is not None:
            self.prefix_cache.flush()

    def close(self) -> None:
        """Give back the device memory: the runner's (weights, KV pool, graphs) and the engine's own. The engine
        cannot step afterwards."""
        self._in_flight = None
        self._row_tokens = None
        self._token_counts = None
        self.scheduler = self.prefix_cache = None  # they hold the KV pool
        self.runner.close()

    def kv_usage(self) -> KVUsage:
        kv = self.runner.kv
        pages = {r.request_id: kv.pages_of(r.row) for r in self.scheduler.running}
        in_use = set().union(*pages.values())
        cached = [p for p in self.prefix_cache.pages() if p not in in_use] if self.prefix_cache is not None else []
        return KVUsage(
            page_size=kv.page_size,
            pages_total=kv.allocator.num_pages,
            pages_free=kv.allocator.free_count,
            pages_held={rid: len(p) for rid, p in pages.items()},
            rows_free=kv.req_to_token.free_count,
            rows_total=kv.req_to_token.max_requests,
            pages_cached=len(cached),
            pages_in_use=len(in_use),
        )

    def prefill_stats(self) -> PrefillStats:
        """Prompt tokens computed and found in the prefix cache since the engine started."""
        return PrefillStats(self.scheduler.num_prefill_tokens, self.scheduler.num_cached_tokens)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self._in_flight is not None

    def step(self) -> list[Request]:
        """Advance by one step; returns the requests that received a token (finished ones included)."""
        step = self.scheduler.schedule()
        if not self.overlap:
            return self._complete(self._launch(step) if step is not None else None)
        if step is not None and any(step.requests[i].grammar is not None for i in step.sampling):
            # A grammar's next mask needs its previous token on the host. The forward pass goes first; the step in
            # flight completes while it runs (the grammars take their tokens), then the masks and the sampling.
            queued = self._queue_forward(step)
            done = self.complete_in_flight()
            self._in_flight = self._queue_sampling(queued)
            return done
        launched = self._launch(step) if step is not None else None
        previous, self._in_flight = self._in_flight, launched
        return self._complete(previous)

    def _launch(self, step: ScheduledStep) -> _Launched:
        """Queue the forward pass and sampling of `step` and the copy of its tokens to the host; wait for nothing."""
        return self._queue_sampling(self._queue_forward(step))

    def _queue_forward(self, step: ScheduledStep) -> _Forwarded:
        """Queue the forward pass of `step`, and its sampling where the decode graph samples it (no grammar). The
        requests' host state is read here: the step's sampling uses what it was at this step."""
        batch = step.batch
        if step.has_pending_inputs:
            # Tokens that have not reached the host yet: take them where the sampler left them, on the device.
            # In place: the ids stay a view of the batch's packed inputs, which a graph replay copies in one go.
            ids = batch.input_ids
            torch.where(ids == PENDING_TOKEN, self._row_tokens[batch.req_pool_indices], ids, out=ids)
            batch.input_ids_pending = True
        requests = [step.requests[i] for i in step.sampling]
        params = [r.params for r in requests]
        vocab = self.runner.shape.vocab_size
        history = self._token_history(requests, vocab) if any(p.adjusts_logits for p in params) else None
        token_index = [len(r.output_ids) + r.num_pending for r in requests]
        queued = _Forwarded(step, requests, params, token_index, history)
        every_row_samples = batch.mode is ForwardMode.DECODE and len(requests) == batch.batch_size
        if every_row_samples and all(r.grammar is None for r in requests):
            # The runner samples inside the decode graph where it can.
            _, queued.sampled = self.runner.forward_and_sample(batch, params, token_index, history)
            return queued
        logits = self.runner.forward(batch)
        queued.prompt_logprobs = prompt_logprobs(step, logits)
        if requests:
            rows = step.sampling
            if step.every_logit is not None:  # some requests' logits span their whole chunk: where each one's last is
                last = logit_rows(step)
                rows = [last[i] for i in step.sampling]
            queued.logits = logits[rows] if rows != list(range(logits.shape[0])) else logits
        return queued

    def _queue_sampling(self, queued: _Forwarded) -> _Launched:
        """Queue the sampling of a forwarded step (its grammars' masks are filled now, while the device runs the
        forward pass) and the copy of its tokens to the host."""
        requests = queued.requests
        if not requests:
            done = None
            if queued.prompt_logprobs:
                done = self.runner.platform.event()
                done.record()
            return _Launched(queued.step, [], None, None, None, None, done=done, prompt_logprobs=queued.prompt_logprobs)
        out = queued.sampled
        if out is None:
            bitmask = self._token_bitmask(requests, self.runner.shape.vocab_size, self.runner.device)
            out = self.runner.sample(queued.logits, queued.params, queued.token_index, queued.history, bitmask)
        history = queued.history
        if history is not None and history.kept is not None:
            self._token_counts.add(history.kept, out.token_ids)
        for req in requests:
            req.num_pending += 1
        if self.overlap:
            step = queued.step
            rows = step.batch.req_pool_indices
            if len(requests) != step.batch.batch_size:
                rows = rows[step.sampling]
            self._row_tokens[rows] = out.token_ids
        outputs = (out.token_ids, out.logprobs, out.top_logprob_ids, out.top_logprobs)
        # A copy even where the device is the host: the outputs may be static tensors the next step overwrites.
        to_host = [None if t is None else t.to("cpu", non_blocking=True, copy=True) for t in outputs]
        done = self.runner.platform.event()
        done.record()
        return _Launched(queued.step, requests, *to_host, done=done, prompt_logprobs=queued.prompt_logprobs)

    def _token_bitmask(self, requests: list[Request], vocab: int, device: torch.device) -> torch.Tensor | None:
        """The tokens each request's grammar allows next (None when no request has one), on the device. A request
        that stopped at the step before (overlap: this step was forwarded ahead of knowing) keeps an open row: its
        token is dropped."""
        rows = [row for row, r in enumerate(requests) if r.grammar is not None and not r.finished]
        if not rows:
            return None
        bitmask = allocate_token_bitmask(len(requests), vocab)
        self.grammars.fill_bitmasks([requests[row].grammar for row in rows], bitmask, rows)
        return bitmask.to(device, non_blocking=True)

    def _token_history(self, requests: list[Request], vocab_size: int) -> TokenHistory:
        """What penalties and min_tokens read: each request's tokens, and the device's counts of them (penalties).
        The counts hold a request's newest token, where only the device has it (overlap scheduling), too."""
        prompts, outputs = [r.prompt_ids for r in requests], [r.output_ids for r in requests]
        kept = self._token_counts.view(
            owners=[r.request_id for r in requests],
            rows=[r.row for r in requests],
            params=[r.params for r in requests],
            prompt_ids=prompts,
            output_ids=outputs,
            pending=[r.num_pending for r in requests],
            row_tokens=self._row_tokens,
            vocab_size=vocab_size,
        )
        return TokenHistory(prompts, outputs, eos_token_ids=sorted(self.eos_token_ids), kept=kept)

    def _complete(self, launched: _Launched | None) -> list[Request]:
        """Wait for a launched step's tokens, append them and apply the stop rules."""
        if launched is None:
            return []
        updated: list[Request] = []
        if launched.done is not None:
            launched.done.synchronize()
        for part in launched.prompt_logprobs:
            part.write()
        if launched.requests:
            updated = self._append_tokens(launched)
        now, mode = time.perf_counter(), launched.step.batch.mode
        if mode is ForwardMode.DECODE and self._last_completion is not None:
            last_time, last_mode = self._last_completion
            if last_mode is ForwardMode.DECODE:
                batch = launched.step.batch
                self.decode_steps.append((now - last_time, batch.batch_size, int(batch.seq_lens_cpu.sum())))
        self._last_completion = (now, mode)
        return updated

    def _append_tokens(self, launched: _Launched) -> list[Request]:
        tokens = launched.token_ids.tolist()
        logprobs = launched.logprobs.tolist() if launched.logprobs is not None else None
        top_ids = launched.top_logprob_ids.tolist() if launched.top_logprob_ids is not None else None
        top_values = launched.top_logprobs.tolist() if launched.top_logprobs is not None else None
        now = time.perf_counter()
        updated = []
        for i, (req, token) in enumerate(zip(launched.requests, tokens, strict=True)):
            req.num_pending -= 1
            if req.finished:
                continue  # it stopped at an earlier step; this token was computed ahead of knowing that
            updated.append(req)
            if req.params.max_new_tokens == 0:  # the prompt only (its logprobs): the token is not wanted
                self._finish(req, FinishReason.LENGTH)
                continue
            req.output_ids.append(token)
            if req.grammar is not None and not req.grammar.accept_token(token):
                raise StructuredOutputError(f"request {req.request_id}: its grammar refused token {token} it allowed")
            if req.first_token_time is None:
                req.first_token_time = now
            n_top = req.params.logprobs
            if n_top is not None:
                req.logprobs.append(logprobs[i])
                if n_top:
                    req.top_logprobs.append(list(zip(top_ids[i][:n_top], top_values[i][:n_top], strict=True)))
            self._check_stop(req, token)
            if req.grammar is not None and req.grammar.is_terminated() and not req.finished:
                self._finish(req, FinishReason.STOP)  # the output is complete (its stop token was not an EOS)
        return updated

    def _check_stop(self, req: Request, token: int) -> None:
        params = req.params
        if req.detokenizer is not None:
            new_text = req.detokenizer.add([token])
            # (stop strings, like EOS, do not end a request before min_tokens)
            cut = req.detokenizer.find_stop(len(new_text)) if len(req.output_ids) >= params.min_tokens else -1
            if cut >= 0:
                self._finish(req, FinishReason.STOP)
                req.detokenizer.text = req.detokenizer.text[:cut]  # the text ends before the stop string (as in vLLM)
                return
        if (token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
            self._finish(req, FinishReason.STOP)
        elif req.length_reached(self.runner.context_length):
            self._finish(req, FinishReason.LENGTH)

    def _finish(self, req: Request, reason: FinishReason) -> None:
        req.finish_reason, req.finish_time = reason, time.perf_counter()
        if req.detokenizer is not None:
            req.detokenizer.flush()
        self.requests.pop(req.request_id, None)
        self.scheduler.finish(req)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def text_of(self, req: Request) -> str | None:
        """The output text (cut before the stop string where one ended it); None without a tokenizer."""
        if req.detokenizer is not None:
            return req.detokenizer.text
        return None if self.tokenizer is None else self.decode(req.output_ids, req.params.skip_special_tokens)
