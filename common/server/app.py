"""The FastAPI application of `omnirun serve`: OpenAI's routes over one engine (an LLM, or an EngineProcess).

/v1/completions, /v1/chat/completions, /v1/responses and /v1/models (behind the API key when one is set),
/health, /metrics.
"""

from __future__ import annotations

import secrets
from typing import Annotated

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from omnirun.engine import LLM
from omnirun.engine.client import EngineClient
from omnirun.server.async_engine import AsyncEngine
from omnirun.server.body_limit import DEFAULT_MAX_REQUEST_BYTES, BodySizeLimit
from omnirun.server.chat import create_chat_completion
from omnirun.server.completions import create_completion
from omnirun.server.errors import OpenAIError, install_error_handlers
from omnirun.server.metrics import CONTENT_TYPE, ServerMetrics
from omnirun.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    now,
)
from omnirun.server.responses import create_response
from omnirun.server.responses_protocol import ResponsesRequest, ResponsesResponse
from omnirun.server.state import ServerState
from omnirun.server.tool_parsers import get_tool_parser

_bearer = HTTPBearer(auto_error=False)


# The dependencies are coroutines: FastAPI runs a plain `def` dependency in its thread pool, a hop per request.
async def _state(request: Request) -> ServerState:
    return request.app.state.server


async def _check_key(
    state: Annotated[ServerState, Depends(_state)],
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> None:
    if state.api_key is None:
        return
    given = credentials.credentials if credentials is not None else ""
    if not secrets.compare_digest(given.encode(), state.api_key.encode()):
        what = "a wrong API key" if credentials is not None else "no API key"
        raise OpenAIError(401, f"{what}: send 'Authorization: Bearer <the server's --api-key>'", code="invalid_api_key")


def create_app(
    llm: LLM | EngineClient,
    *,
    served_model_name: str | None = None,
    api_key: str | None = None,
    max_queued_requests: int | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    tool_call_parser: str | None = None,
) -> FastAPI:
    """The server's app over an open LLM, or an EngineProcess (which stays the caller's to close). A request body
    over `max_request_bytes` is answered with 413 before it is parsed. `tool_call_parser` (a name of
    tool_parsers.TOOL_PARSERS) reads tool calls out of chat output when a request sends tools."""
    parser = get_tool_parser(tool_call_parser) if tool_call_parser is not None else None
    engine = AsyncEngine(llm, max_queued_requests=max_queued_requests)
    client = engine.client
    state = ServerState(engine, served_model_name or client.facts.model, api_key, tool_parser=parser)
    metrics = ServerMetrics(engine)
    app = FastAPI(title="omnirun", description="OpenAI-compatible server over the omnirun engine")
    app.state.server = state
    install_error_handlers(app)
    app.add_middleware(BodySizeLimit, max_bytes=max_request_bytes)

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(_check_key)])

    @v1.post("/completions", response_model=CompletionResponse)
    async def completions(body: CompletionRequest, raw: Request):
        return await create_completion(body, raw, state)

    @v1.post("/chat/completions", response_model=ChatCompletionResponse)
    async def chat_completions(body: ChatCompletionRequest, raw: Request):
        return await create_chat_completion(body, raw, state)

    @v1.post("/responses", response_model=ResponsesResponse)
    async def responses(body: ResponsesRequest, raw: Request):
        return await create_response(body, raw, state)

    @v1.get("/models", response_model=ModelList)
    async def models() -> ModelList:
        card = ModelCard(id=state.served_model_name, created=now(), max_model_len=client.facts.context_length)
        return ModelList(data=[card])

    app.include_router(v1)

    @app.get("/health")
    async def health() -> Response:
        client.check_alive()  # a dead engine thread or process: EngineClosedError, a 500
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return app
