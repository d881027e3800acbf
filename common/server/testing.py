"""A server in a thread of this process, on a free port: what the server's tests (and a user's) talk to; and the
wait for an `omnirun serve` started as a process of its own."""

from __future__ import annotations

import contextlib
import dataclasses
import random
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from typing import Any

from fastapi import FastAPI


@contextlib.contextmanager
def running_server(app: FastAPI, *, timeout_s: float = 30.0) -> Iterator[str]:
    """Serve `app` with uvicorn on 127.0.0.1 and a port the OS picked (bound before the server starts, so no other
    process can take it); yields the base URL, and stops the server on leaving."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            sock.close()
            raise RuntimeError(f"the test server did not start on port {port}")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout_s)
        sock.close()


def wait_until_healthy(url: str, server: subprocess.Popen, *, timeout_s: float = 120.0) -> None:
    """Wait for `omnirun serve` at `url`, started as `server`, to answer /health with 200; AssertionError with its
    output if it exits first, or when `timeout_s` passes."""
    import httpx

    deadline, answer = time.monotonic() + timeout_s, "no answer"
    while True:
        assert server.poll() is None, server.communicate()
        try:
            status = httpx.get(f"{url}/health").status_code
            if status == 200:
                return
            answer = f"/health answered {status}"
        except httpx.TransportError as exc:
            answer = f"no answer ({exc!r})"
        # (a server that answers, but never 200, must time out too)
        assert time.monotonic() < deadline, f"the server was not healthy within {timeout_s:.0f} s: {answer}"
        time.sleep(0.2)


def script_pieces(script: str) -> list[str]:
    """`script` in pieces of 1 to 6 characters: one per token the model generates, cut where a tokenizer would not."""
    rng, pieces, at = random.Random(0), [], 0
    while at < len(script):
        size = rng.randint(1, 6)
        pieces.append(script[at : at + size])
        at += size
    return pieces


class ScriptedText:
    """Wraps AsyncEngine.submit: each request's deltas keep their tokens, but their text is the next pieces of
    `script` (a piece per token, the rest with the last delta), and the last delta's finish reason is
    `finish_reason` where one is given. Run with max_tokens = the number of pieces and ignore_eos, the model says
    exactly `script`: what a test of a parser needs from a model whose weights are random."""

    def __init__(self, submit: Any, script: str, *, finish_reason: str | None = None):
        self._submit, self._pieces, self._reason = submit, script_pieces(script), finish_reason

    def __call__(self, requests: Any) -> _ScriptedGroup:
        return _ScriptedGroup(self._submit(requests), self._pieces, self._reason)


class _ScriptedGroup:
    def __init__(self, group: Any, pieces: list[str], finish_reason: str | None):
        self._group, self._pieces, self._reason = group, pieces, finish_reason
        self.requests = group.requests

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc_info):
        self._group.abort()

    def abort(self) -> None:
        self._group.abort()

    async def __aiter__(self):
        said = [0] * len(self.requests)
        async for index, delta in self._group:
            end = len(self._pieces) if delta.finish_reason is not None else said[index] + len(delta.token_ids)
            text, said[index] = "".join(self._pieces[said[index] : end]), end
            reason = delta.finish_reason and (self._reason or delta.finish_reason)
            yield index, dataclasses.replace(delta, text=text, finish_reason=reason)
