"""The OpenAI API's request and response bodies, as pydantic models (FastAPI checks requests against them).

Field names, defaults and shapes are OpenAI's; the extra sampling fields (top_k, min_p, repetition_penalty,
min_tokens, stop_token_ids, ignore_eos) are vLLM's. Unknown request fields are ignored, as OpenAI and vLLM do.
Ranges FastAPI cannot express are checked by SamplingParams, whose one-line errors become 400s too.
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Annotated, Literal

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
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0)
    logit_bias: dict[str, float] | None = None
    min_tokens: int = Field(0, ge=0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    return_tokens_as_token_ids: bool = False  # vLLM's: logprobs name tokens "token_id:<id>" (no decoding)


class CompletionRequest(_SamplingFields):
    prompt: Text | list[int] | list[Text] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)  # 0: the prompt only (echo, its logprobs)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False


class ContentPart(_Request):
    type: str
    text: Text | None = None  # other kinds of part (image_url, ...) are refused by the chat route


class ChatMessage(_Request):
    # OpenAI's roles ("function" is its deprecated one); the chat template decides what it makes of each.
    role: Literal["system", "user", "assistant", "tool", "developer", "function"]
    content: Text | list[ContentPart] | None = None
    name: Text | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True


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


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None


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


class ChatStreamChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None


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
