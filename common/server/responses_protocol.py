"""The bodies of POST /v1/responses (OpenAI's Responses API) and of its stream's events, as pydantic models.

Field names and shapes are those of the openai SDK's `openai.types.responses` (Response, ResponseOutputMessage,
ResponseOutputText, ResponseFunctionToolCall, ResponseUsage and the stream events). The request takes the same vLLM
sampling extras as chat (top_k, min_p, seed, stop, ...) and, as chat does, ignores fields it does not know. Fields the
route refuses in part (previous_response_id, tools of other kinds than function, ...) are accepted loosely here, so
that responses.py answers them with one line that names what is not built, rather than a schema error.
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import BaseModel, Field

from omnirun.server.protocol import Text, _Request

# --- the request ---


class InputContentPart(_Request):
    type: str  # input_text, or output_text (an earlier response's output sent back); others are refused
    text: Text | None = None


class InputItem(_Request):
    """One item of `input`: a message, an earlier function_call, or a function_call_output answering one (the route
    refuses the other kinds)."""

    type: str = "message"
    role: str | None = None  # user, assistant, system or developer (checked by the route, to name the item)
    content: Text | list[InputContentPart] | None = None
    call_id: Text | None = None  # a function_call's, and the function_call_output's that answers it
    name: Text | None = None  # a function_call's
    arguments: Text | None = None  # a function_call's: a JSON object, as text
    output: Text | None = None  # a function_call_output's


class TextFormat(_Request):
    type: Literal["text", "json_schema", "json_object"]
    name: Text | None = None  # json_schema's
    description: Text | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # (`schema` would shadow BaseModel's)
    strict: bool | None = None  # enforced either way, as vLLM does


class TextConfig(_Request):
    format: TextFormat | None = None


class Tool(_Request):
    type: str  # function (the route refuses the other kinds: web_search, file_search, ...)
    name: Text | None = None
    description: Text | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None


class ResponsesRequest(_Request):
    model: Text | None = None
    input: Text | list[InputItem]
    instructions: Text | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    user: Text | None = None
    metadata: dict[str, Text] | None = None
    store: bool | None = None  # accepted either way: this server keeps nothing
    # Refused by the route, with why: state this server does not keep.
    previous_response_id: Text | None = None
    conversation: Any = None
    background: bool | None = None
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None  # none, auto, required, or {"type": "function", "name": ...}
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    # vLLM's sampling extras, as chat takes them (generation.sampling_params reads them all)
    top_k: int = -1
    min_p: float = Field(0.0, ge=0, le=1)
    seed: int | None = None
    stop: Text | list[Text] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0)
    logit_bias: dict[str, float] | None = None
    min_tokens: int = Field(0, ge=0)
    skip_special_tokens: bool = True  # False keeps special tokens in the text


# --- the response ---


def new_item_id(prefix: str) -> str:
    """OpenAI's ids of the Responses API: resp_..., msg_... (chat's are chatcmpl-...)."""
    return f"{prefix}_{uuid.uuid4().hex}"


Status = Literal["in_progress", "completed", "incomplete"]


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    role: Literal["assistant"] = "assistant"
    status: Status
    content: list[OutputText]


class FunctionCallItem(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str  # a JSON object, as text
    status: Status


OutputItem = OutputMessage | FunctionCallItem


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    cache_write_tokens: int = 0  # the prefix cache keeps pages implicitly: no write is asked for or counted


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"] = "max_output_tokens"


class ResponsesResponse(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Status
    completed_at: int | None = None
    incomplete_details: IncompleteDetails | None = None
    error: None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    # The request's parameters, echoed as the SDK's Response requires them.
    instructions: str | None = None
    metadata: dict[str, str] | None = None
    max_output_tokens: int | None = None
    temperature: float
    top_p: float
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    previous_response_id: None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})  # the request's, as sent
    truncation: Literal["disabled"] = "disabled"
    background: bool = False
    user: str | None = None


# --- the stream's events (each numbered by the route, in the order sent) ---


class ResponseStateEvent(BaseModel):
    type: Literal["response.created", "response.in_progress", "response.completed"]
    sequence_number: int
    response: ResponsesResponse


class OutputItemEvent(BaseModel):
    type: Literal["response.output_item.added", "response.output_item.done"]
    sequence_number: int
    output_index: int
    item: OutputItem


class ContentPartEvent(BaseModel):
    type: Literal["response.content_part.added", "response.content_part.done"]
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class TextDeltaEvent(BaseModel):
    type: Literal["response.output_text.delta"] = "response.output_text.delta"
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any] = Field(default_factory=list)


class TextDoneEvent(BaseModel):
    type: Literal["response.output_text.done"] = "response.output_text.done"
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any] = Field(default_factory=list)


class ArgumentsDeltaEvent(BaseModel):
    type: Literal["response.function_call_arguments.delta"] = "response.function_call_arguments.delta"
    sequence_number: int
    item_id: str
    output_index: int
    delta: str


class ArgumentsDoneEvent(BaseModel):
    type: Literal["response.function_call_arguments.done"] = "response.function_call_arguments.done"
    sequence_number: int
    item_id: str
    output_index: int
    arguments: str
