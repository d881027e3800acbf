"""What a request's output must match: a JSON schema, any JSON object, a regular expression, one of some strings,
or an EBNF grammar (vLLM's `structured_outputs` / `guided_*` kinds, OpenAI's `response_format`); and, for the
server's `auto` tool calls, an xgrammar structural tag."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Literal

from omnirun.errors import SamplingParamsError

Kind = Literal["json_schema", "json_object", "regex", "choice", "ebnf", "structural_tag"]
KINDS: tuple[str, ...] = ("json_schema", "json_object", "regex", "choice", "ebnf", "structural_tag")


@dataclasses.dataclass(frozen=True)
class GrammarSpec:
    """One constraint. `value` is text so that a spec is hashable (the compile cache's key): the schema as JSON
    (its key order kept), the regex, the EBNF, the choices as a JSON list, the structural tag as JSON; "" for
    json_object."""

    kind: Kind
    value: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise SamplingParamsError(f"structured output kind {self.kind!r} is unknown: use one of {', '.join(KINDS)}")

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str) -> GrammarSpec:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise SamplingParamsError(f"the JSON schema is not JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise SamplingParamsError(f"a JSON schema is an object, got {type(schema).__name__}")
        return cls("json_schema", json.dumps(schema))  # (key order kept: properties come out in it)

    @classmethod
    def json_object(cls) -> GrammarSpec:
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> GrammarSpec:
        return cls("regex", pattern)

    @classmethod
    def choice(cls, options: list[str]) -> GrammarSpec:
        if not options or not all(isinstance(o, str) and o for o in options):
            raise SamplingParamsError("a choice needs a non-empty list of non-empty strings")
        return cls("choice", json.dumps(list(options)))

    @classmethod
    def ebnf(cls, grammar: str) -> GrammarSpec:
        return cls("ebnf", grammar)

    @classmethod
    def structural_tag(cls, tag: dict[str, Any]) -> GrammarSpec:
        """xgrammar's structural tag (free text, and tagged parts held to their schemas): the server's `auto` tool
        calls (omnirun.server.tool_parsers.tagged)."""
        return cls("structural_tag", json.dumps(tag))
