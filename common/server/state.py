"""What every route of one server reads: the engine, the model's served name, and the token texts."""

from __future__ import annotations

import dataclasses

from omnirun.server.async_engine import AsyncEngine
from omnirun.server.errors import OpenAIError
from omnirun.server.generation import TokenText
from omnirun.server.tool_parsers import ToolParser


@dataclasses.dataclass
class ServerState:
    engine: AsyncEngine
    served_model_name: str
    api_key: str | None = None
    tool_parser: ToolParser | None = None  # --tool-call-parser: how chat output with tools is read for calls

    def __post_init__(self) -> None:
        self.token_text = TokenText(self.engine.tokenizer)

    def check_model(self, model: str | None) -> str:
        """The served name; a request naming another model is a 404 (none named: the one served)."""
        if model is not None and model != self.served_model_name:
            raise OpenAIError(
                404,
                f"the model {model!r} does not exist here: this server serves {self.served_model_name!r}",
                param="model",
                code="model_not_found",
            )
        return self.served_model_name

    def token_namer(self, as_ids: bool):
        """How logprobs name a token: its text, or "token_id:<id>" (return_tokens_as_token_ids)."""
        if as_ids or self.engine.tokenizer is None:
            return lambda token_id: f"token_id:{token_id}"
        return self.token_text
