"""Errors in OpenAI's shape — `{"error": {"message", "type", "param", "code"}}` — with the status that fits.

400 for a body that is not JSON, a wrong type, a value out of range, a prompt past the context length; 401 for a
missing or wrong API key; 404 for an unknown model or path; 413 for a body over --max-request-bytes; 503 with
Retry-After when the queue is full; 500 for anything else (a bug: logged, and the server goes on).
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from omnirun.errors import ConfigError, EngineClosedError, EngineStepError, SamplingParamsError
from omnirun.server.async_engine import QueueFullError
from omnirun.server.protocol import OUR_CHECKS
from omnirun.structured import StructuredOutputError

logger = logging.getLogger(__name__)

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    503: "ServiceUnavailableError",
}
RETRY_AFTER_S = 1


class OpenAIError(Exception):
    """An error the client caused or can act on, answered with `status` and OpenAI's error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


class ClientGone(Exception):
    """The client closed the connection before the response was ready (its requests were aborted)."""


def error_response(
    status: int, message: str, *, param: str | None = None, code: str | None = None, headers: dict | None = None
) -> JSONResponse:
    body = {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "InternalServerError" if status >= 500 else "BadRequestError"),
            "param": param,
            "code": code if code is not None else status,
        }
    }
    return JSONResponse(body, status_code=status, headers=headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """One line for the first problem of the body, and the field it is about."""
    errors = exc.errors()
    # A union (prompt: str | list[int] | ...) reports each branch; the field and the first message are enough,
    # unless a branch matched the type and failed a check of ours (a lone surrogate): that one says what is wrong.
    error = next((e for e in errors if e.get("type") in OUR_CHECKS), errors[0])
    if error.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {error.get('msg')}", None
    # (a union branch's tag, "function-after[...]" or "list[int]", is no part of the field's path)
    where = [str(part) for part in error.get("loc", ()) if part != "body" and "[" not in str(part)]
    field = where[0] if where else None
    path = ".".join(where) or "body"
    if error.get("type") in OUR_CHECKS:
        return f"{path}: {error.get('msg')}", field
    return f"{path}: {error.get('msg')} (got {error.get('input')!r:.80})", field


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai(request: Request, exc: OpenAIError) -> JSONResponse:
        return error_response(exc.status, exc.message, param=exc.param, code=exc.code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, field = _validation_message(exc)
        return error_response(400, message, param=field)

    @app.exception_handler(ConfigError)
    @app.exception_handler(SamplingParamsError)
    @app.exception_handler(StructuredOutputError)  # a constraint that does not compile, raised preparing the request
    async def _bad_value(request: Request, exc: Exception) -> JSONResponse:
        return error_response(400, str(exc))

    @app.exception_handler(QueueFullError)
    async def _queue_full(request: Request, exc: QueueFullError) -> JSONResponse:
        return error_response(503, str(exc), headers={"Retry-After": str(RETRY_AFTER_S)})

    @app.exception_handler(EngineStepError)
    @app.exception_handler(EngineClosedError)
    async def _engine(request: Request, exc: Exception) -> JSONResponse:
        return error_response(500, str(exc))

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            message = f"no such path: {request.method} {request.url.path}"
        return error_response(exc.status_code, message, headers=getattr(exc, "headers", None))

    @app.exception_handler(ClientGone)
    async def _gone(request: Request, exc: ClientGone) -> JSONResponse:
        return error_response(499, "the client closed the connection; its requests were aborted")

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error while serving %s", request.url.path)
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")
