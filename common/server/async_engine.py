"""The asyncio front of the engine: requests go to an engine client (an LLM's EngineLoop thread here, or an
EngineProcess), their deltas come back as async streams.

The engine's side puts each item from a thread of its own (the EngineLoop's thread, or the EngineProcess's
reader); an AsyncChannel is a channel it can put on that hands each item to the asyncio event loop through a
Mailbox (one `call_soon_threadsafe` per batch of items, not one per item). The requests of one
HTTP call (its prompts x n choices) share one channel and form a RequestGroup; leaving the group early (a client
that went away, an error) aborts the unfinished ones, whose pages the engine frees at its next step.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from omnirun.engine import LLM, Request, StreamDelta
from omnirun.engine.client import EngineClient, as_engine_client
from omnirun.errors import OmnirunError
from omnirun.sampling import SamplingParams

# How often a waiting request checks that the engine is still alive.
_LIVENESS_CHECK_S = 0.5


class QueueFullError(OmnirunError):
    """More requests wait for their first token than --max-queued-requests allows."""


class Mailbox:
    """Items the engine thread posts for an event loop, handed over with one wake-up per batch of posts.

    A step publishes to every running request's channel; waking the event loop once per step instead of once per
    request keeps the engine thread's cost (a write to the loop's self-pipe each) off the step."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple[AsyncChannel, Any]] = []

    def post(self, channel: AsyncChannel, item: Any) -> None:  # called on the engine thread
        with self._lock:
            self._items.append((channel, item))
            if len(self._items) > 1:
                return  # a wake-up is already on its way
        try:
            self._loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the event loop is closed (server shut down): nobody waits any more
            pass

    def _deliver(self) -> None:
        with self._lock:
            items, self._items = self._items, []
        for channel, item in items:
            channel.push(item)


class AsyncChannel:
    """A channel the engine thread puts `(request_id, item)` on and one asyncio task awaits.

    A list and a future rather than an asyncio.Queue read through asyncio.wait_for: wait_for wraps every read (a
    read per token of every open stream) in a task of its own, and cancels and awaits it at each timeout."""

    def __init__(self, mailbox: Mailbox):
        self._mailbox = mailbox
        self._items: list[tuple[int, Any]] = []
        self._waiter: asyncio.Future | None = None

    def put(self, item: tuple[int, Any]) -> None:  # called on the engine thread
        self._mailbox.post(self, item)

    def push(self, item: tuple[int, Any]) -> None:  # called on the event loop
        self._items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def get_all(self, timeout: float) -> list[tuple[int, Any]]:
        """Every item queued, waiting up to `timeout` for the first (asyncio.TimeoutError after it): a reader that
        fell behind takes what piled up at once instead of waking once per item."""
        if not self._items:
            loop = asyncio.get_running_loop()
            self._waiter = waiter = loop.create_future()
            timer = loop.call_later(timeout, _wake, waiter)
            try:
                await waiter
            finally:
                timer.cancel()
                self._waiter = None
            if not self._items:
                raise asyncio.TimeoutError
        items, self._items = self._items, []
        return items


def _wake(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


class AsyncEngine:
    """One engine (an LLM in this process, or an EngineProcess) served to asyncio callers. `max_queued_requests`:
    how many requests may wait for their first token before new ones are refused with QueueFullError (None: no
    limit)."""

    def __init__(self, engine: LLM | EngineClient, *, max_queued_requests: int | None = None):
        self.client = as_engine_client(engine)
        self.max_queued_requests = max_queued_requests
        self.num_waiting = 0  # requests submitted that have no token yet (only touched on the event loop)
        # Observers of each request's news, for metrics: on_submit(requests), on_delta(request, delta, now), and
        # on_abort(request) for a submitted request that its group ended before it finished (no delta says so).
        self.on_submit: list[Callable[[Sequence[Request]], None]] = []
        self.on_delta: list[Callable[[Request, StreamDelta, float], None]] = []
        self.on_abort: list[Callable[[Request], None]] = []
        self._mailbox: Mailbox | None = None

    @property
    def tokenizer(self) -> Any:
        return self.client.tokenizer

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        return self.client.encode(prompt)

    def make_request(self, prompt_ids: Sequence[int], params: SamplingParams) -> Request:
        """A checked request (ConfigError for a bad prompt or one too long for the context), not queued yet."""
        return self.client.make_request(prompt_ids, params)

    def submit(self, requests: Sequence[Request]) -> RequestGroup:
        """Queue requests made by `make_request` together; their deltas arrive through the group it returns."""
        limit = self.max_queued_requests
        if limit is not None and self.num_waiting + len(requests) > limit:
            raise QueueFullError(
                f"{self.num_waiting} requests are waiting for a first token and this one adds {len(requests)}: "
                f"the server takes at most {limit} (--max-queued-requests); retry later"
            )
        group = RequestGroup(self, requests)
        event_loop = asyncio.get_running_loop()
        if self._mailbox is None or self._mailbox._loop is not event_loop:
            self._mailbox = Mailbox(event_loop)
        channel = AsyncChannel(self._mailbox)
        self.num_waiting += len(requests)
        try:
            self.client.submit(requests, channel)
        except BaseException:
            group.abort()
            raise
        group._channel = channel
        for observe in self.on_submit:
            observe(requests)
        return group


class RequestGroup:
    """The requests of one call. Iterate for `(index, delta)` until every request has finished; `abort()` (or
    `async with`) ends the unfinished ones."""

    def __init__(self, engine: AsyncEngine, requests: Sequence[Request]):
        self._engine = engine
        self.requests = list(requests)
        self._index = {r.request_id: i for i, r in enumerate(self.requests)}
        self._started: set[int] = set()
        self._finished: set[int] = set()
        self._channel: AsyncChannel | None = None
        self._closed = False

    async def __aenter__(self) -> RequestGroup:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.abort()

    def __aiter__(self) -> AsyncIterator[tuple[int, StreamDelta]]:
        return self._deltas()

    async def _deltas(self) -> AsyncIterator[tuple[int, StreamDelta]]:
        client = self._engine.client
        while len(self._finished) < len(self.requests):
            try:
                items = await self._channel.get_all(_LIVENESS_CHECK_S)
            except asyncio.TimeoutError:
                client.check_alive()
                continue
            now = time.perf_counter()
            for request_id, delta in _coalesced(items).items():
                index = self._index[request_id]
                self._mark_started(request_id)
                if delta.finish_reason is not None:
                    self._finished.add(request_id)
                for observe in self._engine.on_delta:
                    observe(self.requests[index], delta, now)
                yield index, delta

    def _mark_started(self, request_id: int) -> None:
        if request_id not in self._started:
            self._started.add(request_id)
            self._engine.num_waiting -= 1

    def abort(self) -> None:
        """End every request of the group that has not finished (idempotent); the engine frees their pages."""
        if self._closed:
            return
        self._closed = True
        client = self._engine.client
        submitted = self._channel is not None
        for request in self.requests:
            self._mark_started(request.request_id)  # no longer waiting, whatever happens next
            if request.request_id not in self._finished:
                client.abort(request.request_id)
                # (the engine's last delta for it goes to a channel nobody reads any more: tell the metrics here)
                for observe in self._engine.on_abort if submitted else ():
                    observe(request)


def _coalesced(items: list[tuple[int, Any]]) -> dict[int, StreamDelta]:
    """The deltas of each request among `items`, joined in order into one (raises an engine error found there).
    Under load the event loop reads several steps' deltas at once; joining them keeps its work per step, not per
    token, so HTTP never slows the engine thread it shares the interpreter with."""
    merged: dict[int, StreamDelta] = {}
    for request_id, item in items:
        if isinstance(item, BaseException):
            raise item
        earlier = merged.get(request_id)
        merged[request_id] = item if earlier is None else earlier.then(item)
    return merged
