"""Tool calls in a model's text, by format (`omnirun serve --tool-call-parser NAME`, as vLLM's flag of that name):
each parser finds the calls of a finished message (`parse`) and of a streamed one (`stream`), the same either way.
"""

from __future__ import annotations

from omnirun.errors import ConfigError
from omnirun.server.tool_parsers.base import ParsedDelta, ToolCall, ToolCallDelta, ToolCallStream, ToolParser
from omnirun.server.tool_parsers.hermes import HermesParser
from omnirun.server.tool_parsers.llama3_json import Llama3JsonParser
from omnirun.server.tool_parsers.mistral import MistralParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (HermesParser, Llama3JsonParser, MistralParser)
}


def get_tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ConfigError(f"no tool call parser {name!r}: use one of {', '.join(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]()


__all__ = [
    "TOOL_PARSERS",
    "ParsedDelta",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallStream",
    "ToolParser",
    "get_tool_parser",
]
