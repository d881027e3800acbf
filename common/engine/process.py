"""The engine in a process of its own, so that the host half of each step never waits for the GIL behind the front
(HTTP, SSE per token for many open streams): the design of SGLang's scheduler process and vLLM v1's EngineCore.

`EngineProcess(model, **flags)` takes what `LLM(model, **flags)` takes; a spawned child (torch and device
runtimes need spawn) builds that LLM — runner, Engine, EngineLoop thread, tensor-parallel ranks — and steps it.
The parent talks to it over two one-way multiprocessing pipes:

- parent -> child: ("add", [(request_id, prompt_ids, SamplingParams), ...]), ("abort", request_id),
  ("call", call_id, name) for a reading between two steps (kv_usage), ("shutdown",).
- child -> parent: ("ready", (model, context_length, vocab_size), description) or ("failed", error class, message)
  once (the description: ModelRunner.describe() and `deterministic`, for the server's start-up line); then
  ("step", deltas, errors, stats) once per round of the engine loop, with every request's delta of that step as
  (request_id, token_ids, text, finish_reason, logprobs, top_logprobs, cached_tokens), the requests ended by an
  error as (request_id, error class, message), and an EngineStats snapshot for /metrics; ("reply", call_id, ok,
  value) to a call.

So the parent's cost is per step (one message to unpickle), not per token. Text is decoded here, in the parent
(as vLLM v1's output processor does), so the child spends no GIL on it — except for requests with stop strings:
the child must see their text to stop at the exact token where a stop string appears (no token computed past
it, the text cut before it, finish reason "stop", exactly as in one process), so it decodes those and sends
their text, and only those.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import multiprocessing
import signal
import threading
import time
from collections.abc import Sequence
from typing import Any

from omnirun import errors
from omnirun.engine.client import ModelFacts
from omnirun.engine.detokenizer import IncrementalDetokenizer
from omnirun.engine.engine import KVUsage
from omnirun.engine.llm import encode_prompt
from omnirun.engine.loop import StreamDelta
from omnirun.engine.process_child import ENGINE_THREAD_DIED, child_main
from omnirun.engine.request import FinishReason, Request
from omnirun.engine.request_checks import check_request
from omnirun.engine.stats import EngineStats
from omnirun.engine.tokenizer import load_tokenizer, tokenizer_dir
from omnirun.errors import EngineClosedError, OmnirunError
from omnirun.sampling import SamplingParams
from omnirun.structured import LazyGrammarBackend

logger = logging.getLogger(__name__)

# How long the child may take to exit after "shutdown" before it is terminated (then killed).
STOP_GRACE_S = 5.0
# How often a caller waiting for the child checks that it is still alive.
_LIVENESS_CHECK_S = 0.5


class _Subscriber:
    __slots__ = ("request", "channel")

    def __init__(self, request: Request, channel: Any):
        self.request, self.channel = request, channel


class EngineProcess:
    """An engine stepped in a child process, behind the EngineClient interface (omnirun.engine.client). Starting
    blocks until the model is loaded; a start-up error of the child is raised here as the one-line error it is."""

    def __init__(self, model: str | None = None, *, tokenizer: str | None = None, **flags: Any):
        if model is None:
            from omnirun.assets.default_model import default_model_dir

            model = default_model_dir()
        model = str(model)
        # The parent's own copy of the tokenizer: it encodes prompts and decodes the text of streams.
        source = tokenizer_dir(tokenizer, model)
        self.tokenizer = load_tokenizer(source) if source is not None else None
        context = multiprocessing.get_context("spawn")
        child_inbox, self._to_child = context.Pipe(duplex=False)
        self._from_child, child_outbox = context.Pipe(duplex=False)
        # Not a daemon: the child starts the tensor-parallel ranks' processes itself (as LLM does).
        self._process = context.Process(
            target=child_main,
            args=(child_inbox, child_outbox, model, tokenizer, flags),
            name="omnirun-engine",
        )
        self._process.start()
        child_inbox.close()  # the child's ends: with them closed here, the child's death reads as EOF
        child_outbox.close()
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()  # guards _subscribers, _calls and _death
        self._subscribers: dict[int, _Subscriber] = {}
        self._calls: dict[int, list] = {}  # call id -> [event, ok, value]
        self._death: str | None = None
        self._closed = False
        self._ids = itertools.count()
        self._call_ids = itertools.count()
        self._stats: EngineStats | None = None
        self.steps_received = 0  # step messages read (one per round of the child's engine loop)
        # Before multiprocessing's own exit hook joins the (non-daemon) child, which would wait forever.
        atexit.register(self.close)
        try:
            (model_name, context_length, vocab_size), description = self._wait_until_ready()
        except BaseException:
            self.close(grace_s=0.0)
            raise
        self.facts = ModelFacts(model_name, context_length, vocab_size)
        # Constraints are compiled here too, so that a bad one is refused before it reaches the child, which compiles
        # the matcher that decodes with the model's EOS ids; this one only checks (xgrammar wants some stop token).
        eos = getattr(self.tokenizer, "eos_token_id", None)
        self._grammars = LazyGrammarBackend(self.tokenizer, vocab_size, [eos if eos is not None else 0])
        self.description: dict[str, Any] = description  # device, dtype, KV tokens, running limit, graphs, ...
        self._reader = threading.Thread(target=self._read, name="omnirun-engine-reader", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int | None:
        return self._process.pid

    # --- the EngineClient interface (any thread) ---
    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        return encode_prompt(self.tokenizer, prompt)

    def make_request(self, prompt_ids: Sequence[int], params: SamplingParams) -> Request:
        facts = self.facts
        prompt_ids = check_request(
            prompt_ids, params, facts.context_length, facts.vocab_size, self.tokenizer is not None
        )
        # Text is decoded here, except for requests with stop strings (the child decodes those: see above).
        detokenizer = None
        if self.tokenizer is not None and not params.stop:
            detokenizer = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=params.skip_special_tokens)
        if params.structured_output is not None:
            self._grammars.matcher(params.structured_output)
        return Request(next(self._ids), prompt_ids, params, detokenizer=detokenizer, arrival_time=time.perf_counter())

    def submit(self, requests: Sequence[Request], channel: Any) -> None:
        with self._lock:
            self._check_open()
            for request in requests:
                self._subscribers[request.request_id] = _Subscriber(request, channel)
        self._send(("add", [(r.request_id, r.prompt_ids, r.params) for r in requests]))

    def abort(self, request_id: int) -> None:
        if self._death is None and not self._closed:
            try:
                self._send(("abort", request_id))
            except EngineClosedError:  # a dead child holds no pages; its requests hear of it from the reader
                pass

    def check_alive(self) -> None:
        if self._death is not None:
            raise EngineClosedError(self._death)
        if not self._process.is_alive():
            raise EngineClosedError(f"the engine process {_how_it_ended(self._process.exitcode)}: restart the server")

    def stats(self) -> EngineStats | None:
        return self._stats

    def kv_usage(self) -> KVUsage:
        """The KV pool's pages now (a reading between two steps of the child)."""
        return self._call("kv_usage")

    # --- lifecycle ---
    def close(self, grace_s: float = STOP_GRACE_S) -> None:
        """Stop the child (live requests end with finish reason "abort") and join it; one that does not exit
        within `grace_s` is terminated, then killed. Idempotent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        try:
            self._send(("shutdown",))
        except EngineClosedError:  # already gone
            pass
        self._process.join(grace_s)
        for stop in (self._process.terminate, self._process.kill):
            if self._process.is_alive():
                stop()
                self._process.join(2.0)
        self._to_child.close()
        reader = getattr(self, "_reader", None)
        if reader is not None:
            reader.join(2.0)  # it tells waiting requests that the engine is closed

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- inside ---
    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError("the engine process is closed: restart the server")
        self.check_alive()

    def _send(self, message: tuple) -> None:
        with self._send_lock:
            try:
                self._to_child.send(message)
            except (OSError, ValueError) as exc:  # a dead child (broken pipe) or a closed connection
                raise EngineClosedError(f"the engine process is gone: {exc}") from None

    def _wait_until_ready(self) -> tuple[tuple[str, int, int], dict[str, Any]]:
        try:
            while not self._from_child.poll(_LIVENESS_CHECK_S):
                if not self._process.is_alive():
                    break
            message = self._from_child.recv()
        except (EOFError, OSError):
            self._process.join(2.0)
            how = _how_it_ended(self._process.exitcode)
            raise EngineClosedError(f"the engine process {how} while starting: see its log above") from None
        if message[0] == "failed":
            self._process.join(STOP_GRACE_S)
            raise _error(message[1], message[2])
        return message[1], message[2]

    def _call(self, name: str) -> Any:
        call_id, done = next(self._call_ids), threading.Event()
        with self._lock:
            self._check_open()
            self._calls[call_id] = slot = [done, None, None]
        self._send(("call", call_id, name))
        while not done.wait(_LIVENESS_CHECK_S):
            self.check_alive()
        _, ok, value = slot
        if not ok:
            raise _error(*value)
        return value

    def _read(self) -> None:
        """The reader thread: every message of the child, until it exits."""
        try:
            while True:
                message = self._from_child.recv()
                if message[0] == "step":
                    self.steps_received += 1
                    self._deliver(*message[1:])
                elif message[0] == "reply":
                    _, call_id, ok, value = message
                    with self._lock:
                        slot = self._calls.pop(call_id, None)
                    if slot is not None:
                        slot[1:] = ok, value
                        slot[0].set()
        except (EOFError, OSError):  # the child exited, or was killed
            pass
        except BaseException:  # a bug here: the requests must not wait forever all the same
            logger.exception("the engine process's reader failed")
        self._ended()

    def _deliver(self, deltas: list[tuple], failed: list[tuple], stats: EngineStats | None) -> None:
        if stats is not None:
            self._stats = stats  # before the deltas: a client that sees its request end then reads fresh metrics
        with self._lock:
            subscribers = [self._subscribers.get(d[0]) for d in deltas]
            for request_id, reason in ((d[0], d[3]) for d in deltas):
                if reason is not None:
                    self._subscribers.pop(request_id, None)
            ended = [(self._subscribers.pop(f[0], None), f) for f in failed]
        for subscriber, (request_id, token_ids, text, reason, logprobs, top, cached, prompt, prompt_top) in zip(
            subscribers, deltas, strict=True
        ):
            if subscriber is None:
                continue
            request = subscriber.request
            request.cached_tokens = cached
            detokenizer = request.detokenizer
            if text is None and detokenizer is not None:
                # One token at a time, as the engine adds them: the same text as in one process.
                text = "".join([detokenizer.add((token,)) for token in token_ids])
                if reason is not None:
                    text += detokenizer.flush()
            if reason is not None:
                request.finish_reason = FinishReason(reason)
            delta = StreamDelta(request_id, token_ids, text, reason, logprobs, top, prompt, prompt_top)
            subscriber.channel.put((request_id, delta))
        for subscriber, (request_id, kind, message) in ended:
            if subscriber is not None:
                subscriber.channel.put((request_id, _error(kind, message)))

    def _ended(self) -> None:
        """The child is gone: every waiting request and call hears of it now."""
        self._process.join(2.0)
        if self._closed:
            death = "the engine process is closed: restart the server"
        else:
            how = _how_it_ended(self._process.exitcode)
            death = f"the engine process {how}: see its log; restart the server"
            logger.error("%s", death)
        with self._lock:
            self._death = death
            subscribers, self._subscribers = self._subscribers, {}
            calls, self._calls = self._calls, {}
        for request_id, subscriber in subscribers.items():
            subscriber.channel.put((request_id, EngineClosedError(death)))
        for slot in calls.values():
            slot[1:] = False, ("EngineClosedError", death)
            slot[0].set()


def _error(kind: str, message: str) -> Exception:
    """The child's error, as the class it was where omnirun defines it (so a ConfigError stays one)."""
    cls = getattr(errors, kind, None)
    if isinstance(cls, type) and issubclass(cls, OmnirunError):
        error = cls.__new__(cls)  # (some take other arguments than the message)
        error.args = (message,)
        return error
    return OmnirunError(f"the engine process failed: {kind}: {message}")


def _how_it_ended(exitcode: int | None) -> str:
    if exitcode is None:
        return "stopped answering"
    if exitcode == ENGINE_THREAD_DIED:
        return f"lost its engine thread (exit code {exitcode}; the traceback is in the log)"
    if exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode}"
