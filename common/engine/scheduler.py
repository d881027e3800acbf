"""Continuous batching over the runner's paged KV cache.

Each step is one forward pass of one kind:
- PREFILL (EXTEND) when requests are waiting and fit: new requests, and the next chunk of a prompt longer than the
  chunk size, under a token budget;
- DECODE otherwise: one new token for every running request.
Pages are allocated per step and freed when a request finishes. When a decode step does not fit in the pool, the
most recently started requests are *preempted*: their pages are freed and they go back to the front of the queue,
to be recomputed (prompt + what they had generated) when room returns. A request is never dropped or duplicated.

With overlap scheduling the engine schedules a step while the previous one still runs, so a request may have
tokens sampled on the device that the host has not read (`num_pending`). Such a request decodes on (the engine
feeds its token on the device); it is neither scheduled past its length limit nor recomputed before its pending
tokens arrive.
"""

from __future__ import annotations

import collections
import dataclasses

import torch

from omnirun.batch import ForwardBatch, build_batch
from omnirun.engine.request import Request
from omnirun.memory import KVMemory


@dataclasses.dataclass
class ScheduledStep:
    batch: ForwardBatch
    requests: list[Request]  # in batch order
    # Indices into `requests` (and rows of the logits) whose last position yields their next token: every request
    # of a decode step; in a prefill step, those whose whole sequence is now cached (not mid-way chunks).
    sampling: list[int]
    # Some requests of this decode step feed a token still on the device (pending): their input id is
    # PENDING_TOKEN, for the engine to replace with the token the sampler left for their row.
    has_pending_inputs: bool = False


PENDING_TOKEN = -1


class Scheduler:
    def __init__(
        self,
        kv: KVMemory,
        device: torch.device,
        *,
        max_running_requests: int,
        max_prefill_tokens: int,
        chunked_prefill_size: int,
        context_length: int,
    ):
        self.kv = kv
        self.device = device
        self.max_running_requests = max_running_requests
        self.max_prefill_tokens = max_prefill_tokens
        self.chunked_prefill_size = chunked_prefill_size
        self.context_length = context_length
        self.waiting: collections.deque[Request] = collections.deque()
        # Requests holding KV rows, in the order they started (preemption takes from the end).
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledStep | None:
        """The next step to run, or None when there is nothing to do."""
        while self.running or self.waiting:
            step = self._schedule_prefill() or self._schedule_decode()
            if step is not None:
                return step
            if any(r.num_pending for r in self.running) or any(r.num_pending for r in self.waiting):
                return None  # a step in flight will finish or advance requests: wait for it before preempting
            # Nothing fits: half-prefilled prompts hold the pool. Free the latest started until the rest can go on
            # (the pool holds one request of the context length, so a request alone always fits).
            if not self.running:
                raise RuntimeError(f"request {self.waiting[0].request_id} does not fit in an empty KV pool")
            self.preempt(self.running[-1])
        return None

    # --- prefill ---
    def _schedule_prefill(self) -> ScheduledStep | None:
        budget = self.max_prefill_tokens
        chosen: list[tuple[Request, int]] = []  # (request, tokens of it to compute now)
        # Prompts that are mid-way go first (they already hold pages), then new ones in arrival order.
        # Mid-way: more than the newest token uncached (a prompt, or a preempted request's recompute, in chunks).
        midway = [r for r in self.running if r.num_cached < r.num_tokens + r.num_pending - 1]
        decoding = len(self.running) - len(midway)
        free_pages = self.kv.free_tokens // self.kv.page_size
        for req in midway + list(self.waiting):
            if budget <= 0 or req.num_pending:
                break  # (a preempted request's last tokens are still on the device: recompute it once they arrive)
            take = min(req.num_tokens - req.num_cached, self.chunked_prefill_size, budget)
            pages = self._pages_for([*chosen, (req, take)])
            if req.row is None:
                if len(self.running) + sum(r.row is None for r, _ in chosen) >= self.max_running_requests:
                    break
                # Admit only with room left for one decode token of everyone running afterwards, so that
                # admitting does not force a preemption on the very next step (a request alone always goes).
                if self.running or chosen:
                    pages += decoding + len(chosen) + 1
            if pages > free_pages:
                break
            chosen.append((req, take))
            budget -= take
        if not chosen:
            return None
        for req, _ in chosen:
            if req.row is None:
                req.row = self.kv.new_request()
                self.waiting.remove(req)
                self.running.append(req)
        batch = build_batch(
            self.kv,
            [r.row for r, _ in chosen],
            [r.num_cached for r, _ in chosen],
            [r.all_ids[r.num_cached : r.num_cached + n] for r, n in chosen],
            self.device,
        )
        assert batch is not None, "pages were counted before building the batch"
        for req, n in chosen:
            req.num_cached += n
        requests = [r for r, _ in chosen]
        sampling = [i for i, r in enumerate(requests) if r.num_cached == r.num_tokens]
        return ScheduledStep(batch, requests, sampling)

    def _pages_for(self, work: list[tuple[Request, int]]) -> int:
        """Pages that computing `n` more tokens of each request would take (new requests hold none yet)."""
        page = self.kv.page_size
        return sum(-(-(r.num_cached + n) // page) - -(-r.num_cached // page) for r, n in work)

    # --- decode ---
    def _schedule_decode(self) -> ScheduledStep | None:
        # Ready to decode: every token but the newest (known or pending) cached, and not at its length limit.
        decoding = [
            r
            for r in self.running
            if r.num_cached == r.num_tokens + r.num_pending - 1
            and not r.length_reached(self.context_length, ahead=r.num_pending)
        ]
        # Preempting the latest started until everyone left can take one more token.
        while decoding:
            batch = build_batch(
                self.kv,
                [r.row for r in decoding],
                [r.num_cached for r in decoding],
                [[PENDING_TOKEN if r.num_pending else r.all_ids[-1]] for r in decoding],
                self.device,
            )
            if batch is not None:
                for req in decoding:
                    req.num_cached += 1
                pending = any(r.num_pending for r in decoding)
                return ScheduledStep(batch, decoding, list(range(len(decoding))), has_pending_inputs=pending)
            victim = self.running[-1]
            self.preempt(victim)
            if victim in decoding:
                decoding.remove(victim)
        return None

    def preempt(self, req: Request) -> None:
        """Free a running request's pages and queue it first, to recompute its cache when room returns."""
        self.kv.release(req.row)
        req.row, req.num_cached = None, 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.running.remove(req)
        self.waiting.appendleft(req)

    def clear(self) -> None:
        """Forget every request (after a failed step; the engine frees the whole KV pool)."""
        self.waiting.clear()
        self.running.clear()

    def finish(self, req: Request) -> None:
        """Release a finished request's pages and row (or take it out of the queue, if it was preempted)."""
        if req.row is None:
            self.waiting.remove(req)
            return
        self.kv.release(req.row)
        req.row = None
        self.running.remove(req)
