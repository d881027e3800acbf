"""The OpenAI API's request and response bodies, as pydantic models (FastAPI checks requests against them).

Field names, defaults and shapes are OpenAI's; the extra sampling fields (top_k, min_p, repetition_penalty,
min_tokens, stop_token_ids, ignore_eos) are vLLM's. Unknown request fields are ignored, as OpenAI and vLLM do.
Ranges FastAPI cannot express are checked by SamplingParams, whose one-line errors become 400s too.
"""

from __future__ import annotations

import inspect
import re
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field
from pydantic_core import PydanticCustomError

_SURROGATE = re.compile("[\ud800-\udfff]")
# The error types of the checks below (errors.py puts their message first, over the other branches of a union).
OUR_CHECKS = ("lone_surrogate",)


def _no_lone_surrogate(text: str) -> str:
    """JSON can escape half of a UTF-16 pair alone ("\\ud800"), which Python decodes into a str that no tokenizer
    (nor UTF-8) can encode: a 400 here, not a 500 deep in the tokenizer."""
    if text.isascii():  # (a flag of the str: no scan)
        return text
    found = _SURROGATE.search(text)
    if found is not None:
        where = f"\\u{ord(found.group()):04x} at character {found.start()}"  # (no braces: pydantic formats them)
        raise PydanticCustomError(
            "lone_surrogate",
            f"holds a lone UTF-16 surrogate ({where}), which is no Unicode character: send valid UTF-8, or escape "
            "both halves of the pair",
        )
    return text


Text = Annotated[str, AfterValidator(_no_lone_surrogate)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)  # "0.5" for a number is a wrong type: 400


class StreamOptions(_Request):
    include_usage: bool = False


class JsonSchemaFormat(_Request):
    name: Text | None = None  # OpenAI requires a name; vLLM does not, and neither does the grammar
    description: Text | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # (`schema` would shadow BaseModel's)
    strict: bool | None = None  # enforced either way, as vLLM does


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Request):
    """vLLM's `structured_outputs` (its StructuredOutputsParams): one of these; its options are ignored."""

    json_: dict[str, Any] | Text | None = Field(None, alias="json")
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None  # EBNF
    json_object: bool | None = None
    structural_tag: Any = None  # refused by the route, rather than ignored


class _SamplingFields(_Request):
    """What completions and chat share."""

    model: Text | None = None
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int = -1
    min_p: float = Field(0.0, ge=0, le=1)
    seed: int | None = None
    stop: Text | list[Text] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True  # vLLM's: False keeps special tokens in the text
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0)
    logit_bias: dict[str, float] | None = None
    min_tokens: int = Field(0, ge=0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    return_tokens_as_token_ids: bool = False  # vLLM's: logprobs name tokens "token_id:<id>" (no decoding)
    # What the output must match (server/structured.py): OpenAI's response_format, vLLM's structured_outputs and its
    # older guided_* fields; one at most.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | Text | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None


class CompletionRequest(_SamplingFields):
    prompt: Text | list[int] | list[Text] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)  # 0: the prompt only (echo, its logprobs)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False


class ContentPart(_Request):
    type: str
    text: Text | None = None  # other kinds of part (image_url, ...) are refused by the chat route


class FunctionCallParam(_Request):
    name: Text
    arguments: Text  # a JSON object, as text


class ToolCallParam(_Request):
    """A call an earlier assistant message made (sent back with the conversation)."""

    id: Text
    type: Literal["function"] = "function"
    function: FunctionCallParam


class ChatMessage(_Request):
    # OpenAI's roles ("function" is its deprecated one); the chat template decides what it makes of each.
    role: Literal["system", "user", "assistant", "tool", "developer", "function"]
    content: Text | list[ContentPart] | None = None
    name: Text | None = None
    tool_calls: list[ToolCallParam] | None = None  # an assistant's
    tool_call_id: Text | None = None  # a tool's: the call it answers


class FunctionParam(_Request):
    name: Text
    description: Text | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None


class ToolParam(_Request):
    type: Literal["function"]
    function: FunctionParam


class NamedFunction(_Request):
    name: Text


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    tools: list[ToolParam] | None = None
    # None: "auto" with tools, "none" without (OpenAI's defaults)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True  # false: tool_choice required makes one call


# --- responses ---


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class ChatFunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object, as text


class ChatToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ChatFunctionCall


def _is_none(value: object) -> bool:
    return value is None


# Tool-call fields are left out when None, as OpenAI leaves them out: a message without calls, a stream's pieces
# without calls, and a call's later pieces, which carry only what they add (a `"type": null` would overwrite the
# "function" that the OpenAI client's stream accumulator keeps). exclude_if is pydantic 2.12's, which pyproject does
# not require: before it, they go out as null.
_LEFT_OUT_WHEN_NONE = {"exclude_if": _is_none} if "exclude_if" in inspect.signature(Field).parameters else {}


def _omitted() -> Any:
    return Field(None, **_LEFT_OUT_WHEN_NONE)


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ChatToolCall] | None = _omitted()


class ChatFunctionCallDelta(BaseModel):
    name: str | None = _omitted()
    arguments: str | None = _omitted()


class ChatToolCallDelta(BaseModel):
    index: int
    id: str | None = _omitted()
    type: Literal["function"] | None = _omitted()
    function: ChatFunctionCallDelta


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort", "tool_calls"] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ChatToolCallDelta] | None = _omitted()


class ChatStreamChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort", "tool_calls"] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "omnirun"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
