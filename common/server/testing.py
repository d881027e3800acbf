"""A server in a thread of this process, on a free port: what the server's tests (and a user's) talk to; and the
wait for an `omnirun serve` started as a process of its own."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import threading
import time
from collections.abc import Iterator

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

    deadline = time.monotonic() + timeout_s
    while True:
        assert server.poll() is None, server.communicate()
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                return
        except httpx.TransportError:
            assert time.monotonic() < deadline, f"the server did not start within {timeout_s:.0f} s"
            time.sleep(0.2)
