"""The engine process's own side: an LLM (runner, Engine, EngineLoop thread) fed from a pipe, its outputs sent back
one message per round of the engine loop. The wire format is described in omnirun.engine.process.

Threads here: the main thread reads the parent's pipe and hands requests and aborts to the EngineLoop; the engine
thread steps and, after each round, queues that round's deltas as one message; a sender thread pickles and writes
the messages, so that a parent that is slow to read never holds up a step.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import threading
from multiprocessing.connection import Connection
from typing import Any

from omnirun.engine.engine import Engine
from omnirun.engine.llm import LLM
from omnirun.engine.loop import EngineLoop, StreamDelta
from omnirun.engine.request import Request
from omnirun.engine.stats import EngineStats, engine_stats
from omnirun.errors import EngineClosedError, OmnirunError

logger = logging.getLogger(__name__)

# After the parent is gone, how long closing the engine may take before the process exits anyway.
ORPHAN_EXIT_S = 10.0
# How often the main thread, waiting for the parent, checks that the engine thread is still alive.
LIVENESS_CHECK_S = 0.5
# The exit code of a child whose engine thread died (its traceback is in the log): the parent reads the exit as the
# engine's death, so /health answers 500 at once instead of at the next request.
ENGINE_THREAD_DIED = 3
# What the parent may ask between two steps ("call" messages), by name.
CALLS = {"kv_usage": Engine.kv_usage}


def child_main(inbox: Connection, outbox: Connection, model: str, tokenizer: str | None, flags: dict) -> None:
    # Ctrl-C reaches every process of the terminal's group: the parent stops this one in order.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format="omnirun: %(levelname)s: %(message)s")
    try:
        llm = LLM(model, tokenizer=tokenizer, **flags)
    except BaseException as exc:
        if not isinstance(exc, OmnirunError):
            logger.exception("the engine process failed to start")
        first_line = (str(exc).strip().splitlines() or [""])[0]
        outbox.send(("failed", type(exc).__name__, first_line))
        raise SystemExit(1) from None
    sender = _Sender(outbox)
    steps = _StepOutbox(llm.engine, sender)
    llm.engine_loop.after_step = steps.flush
    runner = llm.runner
    facts = (runner.config.model, runner.context_length, runner.shape.vocab_size)
    sender.send(("ready", facts, {**runner.describe(), "warmup_s": llm.warmup_s}))
    steps.flush()  # the first stats, before any step (no request is in yet: the engine thread is idle)
    try:
        alive = _serve(inbox, llm.engine, llm.engine_loop, steps, sender)
    finally:
        llm.close()  # live requests end with finish reason "abort" (sent, if the parent still listens)
        sender.close()
    if not alive:
        raise SystemExit(ENGINE_THREAD_DIED)


def _serve(inbox: Connection, engine: Engine, loop: EngineLoop, steps: _StepOutbox, sender: _Sender) -> bool:
    """Take the parent's messages until it says shutdown or goes away (True), or the engine thread dies (False)."""
    while True:
        try:
            while not inbox.poll(LIVENESS_CHECK_S):
                if not loop.alive:
                    return False
            message = inbox.recv()
        except (EOFError, OSError):  # the parent died: close, and exit even if closing hangs
            threading.Timer(ORPHAN_EXIT_S, os._exit, args=(1,)).start()
            return True
        kind = message[0]
        if kind == "add":
            for request_id, prompt_ids, params in message[1]:
                try:
                    request = engine.make_request(prompt_ids, params)  # a detokenizer only for stop strings
                    request.request_id = request_id  # the parent names requests (none start here)
                    steps.requests[request_id] = request
                    loop.submit(request, steps, stream=True)
                except Exception as exc:
                    steps.requests.pop(request_id, None)
                    sender.send(("step", [], [(request_id, type(exc).__name__, str(exc))], None))
                    if isinstance(exc, EngineClosedError):
                        return loop.alive  # the engine thread is gone: exiting tells the parent
        elif kind == "abort":
            loop.abort(message[1])
        elif kind == "call":
            _, call_id, name = message
            try:
                sender.send(("reply", call_id, True, loop.call(CALLS[name])))
            except Exception as exc:
                sender.send(("reply", call_id, False, (type(exc).__name__, str(exc))))
        elif kind == "shutdown":
            return True


class _StepOutbox:
    """The channel of every request here: the EngineLoop puts deltas on it, and after each round of the loop
    `flush` turns them into one message (tuples, cheaper to pickle than dataclasses) with a stats snapshot."""

    def __init__(self, engine: Engine, sender: _Sender):
        self._engine = engine
        self._sender = sender
        self._items: list[tuple[int, Any]] = []  # only the engine thread touches it
        self._stats: EngineStats | None = None
        self.requests: dict[int, Request] = {}  # live requests by id (for their cached tokens)

    def put(self, item: tuple[int, StreamDelta | BaseException]) -> None:
        self._items.append(item)

    def flush(self) -> None:
        items, self._items = self._items, []
        stats = engine_stats(self._engine)
        if not items and stats == self._stats:
            return
        self._stats = stats
        deltas, errors = [], []
        for request_id, item in items:
            if isinstance(item, BaseException):
                self.requests.pop(request_id, None)
                errors.append((request_id, type(item).__name__, str(item)))
                continue
            request = self.requests.get(request_id)
            cached = request.cached_tokens if request is not None else 0
            if item.finish_reason is not None:
                self.requests.pop(request_id, None)
            deltas.append(
                (request_id, item.token_ids, item.text, item.finish_reason, item.logprobs, item.top_logprobs, cached)
                + (item.prompt_logprobs, item.prompt_top_logprobs)  # (None, None) but in a request's first delta
            )
        self._sender.send(("step", deltas, errors, stats))


class _Sender:
    """Writes messages to the parent from a thread of its own, in order; a closed pipe ends it quietly."""

    def __init__(self, connection: Connection):
        self._connection = connection
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="omnirun-engine-sender", daemon=True)
        self._thread.start()

    def send(self, message: tuple) -> None:
        self._queue.put(message)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(5.0)

    def _run(self) -> None:
        while (message := self._queue.get()) is not None:
            try:
                self._connection.send(message)
            except (OSError, ValueError):  # the parent is gone
                return
