"""A limit on the size of request bodies (`--max-request-bytes`), as plain ASGI middleware: a body over it is
answered with 413 in OpenAI's error shape before the app parses any of it.

A Content-Length over the limit is refused before the body is read; a chunked body (no Content-Length) is counted
as it arrives and refused once it passes the limit, so the server never holds more than the limit of one body.
"""

from __future__ import annotations

from typing import Any

from omnirun.server.errors import error_response

DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024


class _TooLarge(Exception):
    """Raised into the app from `receive` when a chunked body passes the limit."""


class BodySizeLimit:
    def __init__(self, app: Any, max_bytes: int = DEFAULT_MAX_REQUEST_BYTES):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._refuse(scope, receive, send, f"the request body is {declared} bytes:")
            return
        received = 0
        refused = started = False

        async def counting_receive() -> dict:
            nonlocal received, refused
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    refused = True
                    raise _TooLarge()
            return message

        async def guarded_send(message: dict) -> None:
            nonlocal started
            if not refused:  # once refused, the 413 below is the answer, not the app's view of the exception
                started = started or message["type"] == "http.response.start"
                await send(message)

        try:
            await self.app(scope, counting_receive, guarded_send)
        except _TooLarge:
            pass
        if refused and not started:  # (every route here reads its whole body before it answers)
            await self._refuse(scope, receive, send, "the request body is")

    async def _refuse(self, scope: dict, receive: Any, send: Any, what: str) -> None:
        message = f"{what} over this server's limit of {self.max_bytes} bytes (--max-request-bytes)"
        await error_response(413, message)(scope, receive, send)


def _content_length(scope: dict) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the HTTP parser refuses such a request itself
    return None
