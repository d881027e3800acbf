"""The engine in a thread of its own: callers on any thread submit, abort and wait; one thread steps.

The Engine is single-threaded by design (its scheduler, KV bookkeeping and device queue are not shared). An
EngineLoop owns it: a background thread takes what callers handed in since the last step (new requests, aborts,
calls to run between steps), runs one step, and puts each request's news on the channel its caller waits on — a
stream's deltas every step, a plain request's output when it ends. So requests from several threads join one
running batch, every caller gets exactly its own outputs, and a step never races with a caller.

Channels carry `(request_id, item)`, item being a StreamDelta, a RequestOutput, or an exception to raise.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from omnirun.engine.engine import Engine
from omnirun.engine.request import Request, RequestOutput
from omnirun.errors import EngineClosedError, EngineStepError

logger = logging.getLogger(__name__)

Channel = queue.SimpleQueue  # of (request_id, StreamDelta | RequestOutput | BaseException)

# How often a waiting caller checks that the engine thread is still alive.
_LIVENESS_CHECK_S = 0.5


@dataclasses.dataclass
class StreamDelta:
    """What one step added to a streamed request."""

    request_id: int
    token_ids: list[int]  # the new token(s)
    text: str | None  # the new text (None without a tokenizer); may lag a token behind (partial UTF-8, stop strings)
    finish_reason: str | None
    logprobs: list[float] | None = None  # of each new token, when SamplingParams.logprobs is set
    top_logprobs: list[list[tuple[int, float]]] | None = None  # (token id, logprob) of the top-n, when n > 0
    # The prompt's logprobs (RequestOutput's), with the request's first delta, when SamplingParams.prompt_logprobs
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None

    def then(self, later: StreamDelta) -> StreamDelta:
        """This delta followed by `later` (of the same request) as one: what a reader that fell behind by a step
        receives, so that it sends one message for both."""

        def joined(a: list | None, b: list | None) -> list | None:
            return None if a is None and b is None else (a or []) + (b or [])

        text = None if self.text is None and later.text is None else (self.text or "") + (later.text or "")
        return StreamDelta(
            self.request_id,
            self.token_ids + later.token_ids,
            text,
            later.finish_reason,
            joined(self.logprobs, later.logprobs),
            joined(self.top_logprobs, later.top_logprobs),
            self.prompt_logprobs if self.prompt_logprobs is not None else later.prompt_logprobs,
            self.prompt_top_logprobs if self.prompt_top_logprobs is not None else later.prompt_top_logprobs,
        )


@dataclasses.dataclass
class _Subscriber:
    channel: Channel
    stream: bool
    sent_tokens: int = 0
    sent_text: int = 0
    sent_prompt_logprobs: bool = False

    def delta(self, req: Request) -> StreamDelta | None:
        """The tokens and text of `req` not sent yet (None when there is nothing new and it has not finished)."""
        tokens = req.output_ids[self.sent_tokens :]
        text = None
        if req.detokenizer is not None:
            ready = len(req.detokenizer.text) if req.finished else req.detokenizer.stable_length()
            text = req.detokenizer.text[self.sent_text : ready]
            self.sent_text = max(self.sent_text, ready)
        if not tokens and not req.finished:
            return None
        logprobs = top = None
        if req.params.logprobs is not None:
            logprobs = req.logprobs[self.sent_tokens :]
            top = req.top_logprobs[self.sent_tokens :] if req.params.logprobs else None
        self.sent_tokens = len(req.output_ids)
        reason = req.finish_reason.value if req.finished else None
        delta = StreamDelta(req.request_id, tokens, text, reason, logprobs, top)
        if req.prompt_logprobs is not None and not self.sent_prompt_logprobs:  # complete once a token or the end came
            delta.prompt_logprobs, delta.prompt_top_logprobs = list(req.prompt_logprobs), req.prompt_top_logprobs
            self.sent_prompt_logprobs = True
        return delta


@dataclasses.dataclass
class _Call:
    fn: Callable[[Engine], Any]
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None


class EngineLoop:
    def __init__(self, engine: Engine, *, name: str = "omnirun-engine"):
        self.engine = engine
        self._cond = threading.Condition()
        # Handed in by callers, taken by the engine thread at the next step (all under _cond).
        self._new: list[tuple[Request, _Subscriber]] = []
        self._aborts: list[int] = []
        self._calls: list[_Call] = []
        self._closing = False
        # The engine thread's own: who waits for which live request.
        self._subscribers: dict[int, _Subscriber] = {}
        self._death: BaseException | None = None
        # Called on the engine thread after each round of the loop (a step, or what came in between): where an
        # engine process sends the round's outputs to its parent in one message. Set it before the first request.
        self.after_step: Callable[[], None] | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # --- any thread ---
    def submit(self, request: Request, channel: Channel, *, stream: bool = False) -> int:
        """Queue a request made by `engine.make_request`; its news arrive on `channel`. Returns its id."""
        with self._cond:
            self._check_open()
            self._new.append((request, _Subscriber(channel, stream)))
            self._cond.notify()
        return request.request_id

    def abort(self, request_id: int) -> None:
        """End a request at the next step (finish reason "abort"); its pages are freed then. Unknown or finished
        ids are ignored, so aborting twice, or after the end, is harmless."""
        with self._cond:
            if not self._closing:
                self._aborts.append(request_id)
                self._cond.notify()

    def call(self, fn: Callable[[Engine], Any]) -> Any:
        """Run `fn(engine)` on the engine thread between steps, with no step in flight; return what it returns."""
        call = _Call(fn)
        with self._cond:
            self._check_open()
            self._calls.append(call)
            self._cond.notify()
        while not call.done.wait(_LIVENESS_CHECK_S):
            self._check_alive()
        if call.error is not None:
            raise call.error
        return call.result

    def receive(self, channel: Channel, idle: Callable[[], Any] | None = None) -> tuple[int, Any]:
        """The next item on a channel; raises if the engine thread died, never waits forever for a dead one.
        `idle` is called while nothing arrives (a progress bar's refresh)."""
        while True:
            try:
                return channel.get(timeout=_LIVENESS_CHECK_S)
            except queue.Empty:
                self._check_alive()
                if idle is not None:
                    idle()

    def close(self) -> None:
        """Stop the engine thread: requests still live end with finish reason "abort". Idempotent."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        if self._thread is not threading.current_thread():
            self._thread.join()

    @property
    def closed(self) -> bool:
        return self._closing

    @property
    def alive(self) -> bool:
        """Whether the engine thread runs (False once it has died, or stopped after close)."""
        return self._thread.is_alive()

    def check_alive(self) -> None:
        """Raise EngineClosedError if the engine thread has stopped (what a waiting caller checks now and then)."""
        self._check_alive()

    def _check_open(self) -> None:
        if self._closing:
            raise EngineClosedError("this LLM is closed: create a new one")
        self._check_alive()

    def _check_alive(self) -> None:
        if not self._thread.is_alive():
            raise EngineClosedError(f"the engine thread stopped: {self._death!r}; create a new LLM") from self._death

    # --- the engine thread ---
    def _run(self) -> None:
        runner = self.engine.runner
        try:
            runner.platform.set_device(runner.config.device_index)  # the current device is per thread
            while True:
                more = self._run_once()
                if self.after_step is not None:
                    self.after_step()
                if not more:
                    break
        except BaseException as exc:  # a bug of the loop itself: every waiting caller hears of it
            logger.exception("the engine thread died")
            self._death = exc
            for request_id, subscriber in self._subscribers.items():
                subscriber.channel.put((request_id, EngineClosedError(f"the engine thread died: {exc!r}")))
            if self.after_step is not None:
                try:
                    self.after_step()
                except BaseException:  # what failed may be after_step itself
                    pass

    def _run_once(self) -> bool:
        engine = self.engine
        with self._cond:
            while not (self._new or self._aborts or self._calls or self._closing or engine.has_work):
                self._cond.wait()
            new, self._new = self._new, []
            aborts, self._aborts = self._aborts, []
            calls, self._calls = self._calls, []
            closing = self._closing
        for request, subscriber in new:
            self._subscribers[request.request_id] = subscriber
            engine.add(request)
        self._publish([r for r in map(engine.abort, aborts) if r is not None])
        if calls or closing:
            self._publish(self._guarded(engine.complete_in_flight))
        for call in calls:
            try:
                call.result = call.fn(engine)
            except BaseException as exc:
                call.error = exc
            call.done.set()
        if closing:
            self._publish([engine.abort(request_id) for request_id in list(engine.requests)])
            return False
        if engine.has_work:
            self._publish(self._guarded(engine.step))
        return True

    def _guarded(self, advance: Callable[[], list[Request]]) -> list[Request]:
        """Run a step (or the completion of one); if it raises, end the requests the engine held, tell their
        callers, and go on with an empty engine."""
        try:
            return advance()
        except Exception as exc:
            logger.exception("an engine step failed; ending the requests it held")
            self._fail(self.engine.fail_all(), exc)
            return []

    def _publish(self, requests: list[Request]) -> None:
        for req in requests:
            subscriber = self._subscribers.get(req.request_id)
            if subscriber is None:
                continue
            if subscriber.stream:
                delta = subscriber.delta(req)
                if delta is not None:
                    subscriber.channel.put((req.request_id, delta))
            if req.finished:
                del self._subscribers[req.request_id]
                if not subscriber.stream:
                    subscriber.channel.put((req.request_id, RequestOutput.of(req, self.engine.text_of(req))))

    def _fail(self, requests: list[Request], exc: Exception) -> None:
        message = f"an engine step failed, and its requests were ended: {type(exc).__name__}: {exc}"
        for req in requests:
            subscriber = self._subscribers.pop(req.request_id, None)
            if subscriber is not None:
                error = EngineStepError(message)
                error.__cause__ = exc
                subscriber.channel.put((req.request_id, error))
