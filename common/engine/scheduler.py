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

With a prefix cache attached to the KV memory, a new request (or a preempted one coming back) first shares the
pages of the longest cached prefix of its tokens and computes only the rest (at least its last token, for the
logits). The full pages of a prompt go into the cache as soon as the step computing them is launched, so requests
that start later share them; a finished or preempted request leaves all its full pages there. Only tokens the host
knows are cached: a pending token's K/V is computed, but its id is not known yet.
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
    # Per request of a prefill step: whether the logits of each of its new tokens come back (prompt logprobs), not
    # only its last token's (None: none does; see omnirun.batch.logit_counts).
    every_logit: list[bool] | None = None


PENDING_TOKEN = -1

# A new request whose next this many tokens (at least a page) another request of the same step computes waits one
# step and shares them from the prefix cache instead of computing them twice (a system prompt sent by many at once).
SHARE_SPAN = 32


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
        # Prefill tokens computed, and those found in the prefix cache instead, over every admission.
        self.num_prefill_tokens = 0
        self.num_cached_tokens = 0
        # Running requests whose prompt pages are still being computed: they go into the cache step by step.
        self._caching: dict[int, tuple[Request, int]] = {}  # request id -> (request, tokens to cache by then)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledStep | None:
        """The next step to run, or None when there is nothing to do."""
        if self._caching:
            self._cache_prompts()
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
        admitted: list[Request] = []
        for req in midway + list(self.waiting):
            if budget <= 0 or req.num_pending:
                break  # (a preempted request's last tokens are still on the device: recompute it once they arrive)
            new = req.row is None
            if new:
                if len(self.running) + len(admitted) >= self.max_running_requests or not self._admit(req):
                    break
                if self._computed_alongside(req, chosen):
                    self._release(req, keep=False)
                    continue
            take = min(req.num_tokens - req.num_cached, self.chunked_prefill_size, budget)
            pages = self._pages_for([*chosen, (req, take)])
            # Admit only with room left for one decode token of everyone running afterwards, so that admitting does
            # not force a preemption on the very next step (a request alone always goes).
            if new and (self.running or chosen):
                pages += decoding + len(chosen) + 1
            if pages > self.kv.free_pages:  # (what the new request shares from the cache is no longer evictable)
                if new:
                    self._release(req, keep=False)
                break
            chosen.append((req, take))
            budget -= take
            if new:
                admitted.append(req)
        if not chosen:
            return None
        for req in admitted:
            self.waiting.remove(req)
            self.running.append(req)
            self.num_cached_tokens += req.num_cached
            if req.num_preemptions == 0:
                req.cached_tokens = req.num_cached
        every_logit = [r.needs_prompt_logits for r, _ in chosen]
        batch = build_batch(
            self.kv,
            [r.row for r, _ in chosen],
            [r.num_cached for r, _ in chosen],
            [r.all_ids[r.num_cached : r.num_cached + n] for r, n in chosen],
            self.device,
            every_logit=every_logit,
        )
        assert batch is not None, "pages were counted before building the batch"
        for req, n in chosen:
            req.num_cached += n
            self.num_prefill_tokens += n
        requests = [r for r, _ in chosen]
        sampling = [i for i, r in enumerate(requests) if r.num_cached == r.num_tokens]
        return ScheduledStep(batch, requests, sampling, every_logit=every_logit if any(every_logit) else None)

    def _admit(self, req: Request) -> bool:
        """Give a waiting request a row, starting with the pages of its longest cached prefix; False: no row."""
        row = self.kv.new_request()
        if row is None:
            return False
        req.row = row
        cache = self.kv.prefix_cache
        if cache is not None:
            tokens = req.all_ids
            # Its last token is computed, for the logits; with prompt logprobs, every token whose logits are missing.
            limit = len(tokens) - 1 if not req.needs_prompt_logits else 0
            pages, node = cache.match(tokens, limit)
            cache.lock(node)
            self.kv.share_prefix(row, pages)
            req.cache_node, req.num_cached = node, len(pages) * self.kv.page_size
            req.num_in_cache = req.num_cached
            until = len(tokens) // self.kv.page_size * self.kv.page_size  # its full pages once prefilled
            if until > req.num_in_cache:
                self._caching[req.request_id] = (req, until)
        return True

    def _computed_alongside(self, req: Request, chosen: list[tuple[Request, int]]) -> bool:
        """Whether a request of this step computes the next SHARE_SPAN tokens of `req`, which the cache lacks."""
        if self.kv.prefix_cache is None or req.needs_prompt_logits:
            return False
        start = req.num_cached
        span = max(SHARE_SPAN, self.kv.page_size)
        tokens = req.all_ids[start : start + span]
        return len(tokens) == span and any(
            other.num_cached <= start
            and other.num_cached + n >= start + span
            and other.all_ids[start : start + span] == tokens
            for other, n in chosen
        )

    def _cache_prompts(self) -> None:
        """Put the full pages that launched steps computed for prompts into the cache (a later step that reads them
        runs after those steps on the device)."""
        for rid, (req, until) in list(self._caching.items()):
            if req.row is not None:
                self._cache(req)
            if req.row is None or req.num_in_cache >= until:  # (finished or preempted: it cached what it had then)
                del self._caching[rid]

    def _cache(self, req: Request) -> None:
        """Insert the request's full pages of known tokens into the cache, and lock them for it."""
        cache, page = self.kv.prefix_cache, self.kv.page_size
        full = min(req.num_cached, req.num_tokens) // page
        if cache is None or full * page <= req.num_in_cache:
            return
        node = cache.insert(req.all_ids[: full * page], self.kv.pages_of(req.row)[:full])
        cache.lock(node)
        cache.unlock(req.cache_node)
        req.cache_node, req.num_in_cache = node, full * page

    def _release(self, req: Request, *, keep: bool) -> None:
        """Give back a request's row and pages; `keep`: its full pages stay in the prefix cache."""
        cache = self.kv.prefix_cache
        if cache is not None:
            if keep:
                self._cache(req)
            cache.unlock(req.cache_node)
        self.kv.release(req.row)
        req.row, req.num_cached, req.cache_node, req.num_in_cache = None, 0, None, 0

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
                [[PENDING_TOKEN if r.num_pending else r.last_id] for r in decoding],
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

    def preempt(self, req: Request, *, keep_cache: bool = True) -> None:
        """Free a running request's pages and queue it first, to recompute its cache when room returns (its full
        pages stay in the prefix cache, for it to share again if they are not evicted meanwhile)."""
        self._release(req, keep=keep_cache)
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.running.remove(req)
        self.waiting.appendleft(req)

    def clear(self) -> None:
        """Forget every request (after a failed step; the engine frees the whole KV pool)."""
        self.waiting.clear()
        self.running.clear()
        self._caching.clear()

    def finish(self, req: Request) -> None:
        """Release a finished request's pages and row (or take it out of the queue, if it was preempted)."""
        if req.row is None:
            self.waiting.remove(req)
            return
        self._release(req, keep=True)
        self.running.remove(req)
