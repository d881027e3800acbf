"""What a request's output must match (a GrammarSpec, which the engine's grammar enforces), from the fields that ask:
OpenAI's `response_format` (chat, and completions as vLLM takes it) and Responses `text.format`, vLLM's
`structured_outputs` and older `guided_*` fields, and a `tool_choice` that forces a call (`required` or a named
function); and the forced calls read back out of the constrained text, whole or as it streams.

Building a spec only writes its schema as text; compiling it is the engine's, in make_request, which the routes run
in a worker thread (a large schema takes seconds).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

from omnirun.server.errors import OpenAIError
from omnirun.server.protocol import ResponseFormat, StructuredOutputs
from omnirun.server.tool_parsers import ParsedDelta, ToolCallDelta
from omnirun.server.tool_parsers.base import openai_call_id
from omnirun.structured import GrammarSpec

Constraint = tuple[str, GrammarSpec]  # (the field that asked for it, as a 400 names it; the spec)
NO_PARAMETERS = {"type": "object", "properties": {}}  # a function sent without a parameters schema


def only_one(found: list[Constraint]) -> GrammarSpec | None:
    """The request's constraint, if any; a 400 naming them when several ask (vLLM refuses those too)."""
    if len(found) > 1:
        names = " and ".join(name for name, _ in found)
        field = found[1][0].replace(".", " ").split()[0]  # ("structured_outputs.regex", "tool_choice 'required'")
        raise OpenAIError(400, f"{names} each constrain the output: send only one", param=field)
    return found[0][1] if found else None


def json_schema(schema: dict[str, Any] | str | None, where: str) -> Constraint:
    if schema is None:
        raise OpenAIError(400, f"{where} has no schema: send the JSON schema the output must match", param=where)
    return where, GrammarSpec.json_schema(schema)


def response_format_constraint(fmt: ResponseFormat | None) -> list[Constraint]:
    if fmt is None or fmt.type == "text":
        return []
    if fmt.type == "json_object":
        return [("response_format", GrammarSpec.json_object())]
    if fmt.json_schema is None:
        raise OpenAIError(400, "response_format json_schema needs json_schema: {name, schema}", param="response_format")
    return [json_schema(fmt.json_schema.schema_, "response_format")]


_EXTRAS: dict[str, Callable[[Any], GrammarSpec]] = {
    "json": GrammarSpec.json_schema,
    "regex": GrammarSpec.regex,
    "choice": GrammarSpec.choice,
    "grammar": GrammarSpec.ebnf,
}


def vllm_constraints(body: Any) -> list[Constraint]:
    """vLLM's `structured_outputs: {json, regex, choice, grammar, json_object}` and older `guided_*` fields."""
    found = []
    extras: StructuredOutputs | None = body.structured_outputs
    if extras is not None:
        if extras.structural_tag is not None:
            message = "structured_outputs.structural_tag is not supported: use json, regex, choice or grammar"
            raise OpenAIError(400, message, param="structured_outputs")
        values = {"json": extras.json_, "regex": extras.regex, "choice": extras.choice, "grammar": extras.grammar}
        found += [(f"structured_outputs.{k}", _EXTRAS[k](v)) for k, v in values.items() if v is not None]
        if extras.json_object:
            found.append(("structured_outputs.json_object", GrammarSpec.json_object()))
    for key, make in _EXTRAS.items():
        value = getattr(body, f"guided_{key}")
        if value is not None:
            found.append((f"guided_{key}", make(value)))
    return found


def output_constraints(body: Any) -> list[Constraint]:
    """What a completions or chat body asks of its output (a forced tool choice aside)."""
    return response_format_constraint(body.response_format) + vllm_constraints(body)


# --- tool_choice required / a named function ---


@dataclasses.dataclass(frozen=True)
class ForcedCalls:
    """A tool choice the grammar enforces, as vLLM does it: a named function's output is its arguments (constrained
    by its parameters schema), one call; `required` (function None) outputs a JSON array of at least one
    `{"name": <a tool>, "parameters": <its arguments>}`, each a call. Works without a tool call parser."""

    spec: GrammarSpec
    function: str | None

    @property
    def constraint(self) -> Constraint:
        what = "'required'" if self.function is None else f"naming {self.function!r}"
        return f"tool_choice {what}", self.spec

    def finish_reason(self, reason: str | None) -> str | None:
        # vLLM's, after OpenAI's: "tool_calls" for required, but "stop" for a named function; a cut output keeps
        # "length" (its last call's arguments are then cut too).
        return "tool_calls" if self.function is None and reason == "stop" else reason

    def stream(self) -> NamedCallStream | CallArrayStream:
        return CallArrayStream() if self.function is None else NamedCallStream(self.function)

    def calls(self, text: str) -> list[ToolCallDelta]:
        """The calls of a finished output, each whole (id, name, all its arguments): the stream's, put together."""
        merged: list[ToolCallDelta] = []
        for piece in self.stream().feed(text, last=True).tool_calls:
            if piece.id is not None:
                merged.append(piece)
            else:
                merged[-1] = dataclasses.replace(merged[-1], arguments=merged[-1].arguments + piece.arguments)
        return merged


def named_call(functions: dict[str, dict[str, Any] | None], name: str) -> ForcedCalls:
    if name not in functions:
        message = f"tool_choice names {name!r}, which is not in tools: name one of {', '.join(map(repr, functions))}"
        raise OpenAIError(400, message, param="tool_choice")
    return ForcedCalls(GrammarSpec.json_schema(functions[name] or NO_PARAMETERS), name)


def required_calls(functions: dict[str, dict[str, Any] | None], *, parallel: bool = True) -> ForcedCalls:
    """The array schema of vLLM's `_get_json_schema_from_tools`, each tool's `$defs` moved to its root (where a
    `#/$defs/...` reference now points); parallel_tool_calls false: one call."""
    branches, defs = [], {}
    for name, parameters in functions.items():
        parameters = dict(parameters or NO_PARAMETERS)
        for key in ("$defs", "definitions"):
            for def_name, definition in (parameters.pop(key, None) or {}).items():
                if defs.setdefault((key, def_name), definition) != definition:
                    message = f"tools define {key}/{def_name} differently: rename it in one of them"
                    raise OpenAIError(400, message, param="tools")
        properties = {"name": {"type": "string", "enum": [name]}, "parameters": parameters}
        branches.append(
            {
                "type": "object",
                "properties": properties,
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": branches}}
    if not parallel:
        schema["maxItems"] = 1
    for key, def_name in defs:
        schema.setdefault(key, {})[def_name] = defs[key, def_name]
    return ForcedCalls(GrammarSpec.json_schema(schema), None)


class NamedCallStream:
    """A named function's output, as it comes: all of it is the one call's arguments, streamed in pieces (the grammar
    guarantees they parse, once whole)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self.calls = 0

    def feed(self, text: str, *, last: bool = False) -> ParsedDelta:
        if self.calls == 0:
            self.calls = 1
            return ParsedDelta(tool_calls=(ToolCallDelta(0, openai_call_id(), self._name, text),))
        return ParsedDelta(tool_calls=(ToolCallDelta(0, arguments=text),)) if text else ParsedDelta()


class CallArrayStream:
    """`required`'s output, `[{"name": "f", "parameters": {...}}, ...]`, as it comes: a call starts once its name is
    whole, then its arguments (the text of "parameters") stream as they come. The grammar guarantees the shape;
    this follows only the nesting, the strings, and the keys of each element."""

    def __init__(self) -> None:
        self.calls = 0
        self._depth = 0
        self._in_string = self._escaped = False
        self._string = ""  # the element's key or name being read
        self._key: str | None = None  # the element's key whose value comes next (None: a key comes next)
        self._in_arguments = False
        self._name: str | None = None
        self._held = ""  # arguments written before the name (the grammar puts the name first: never, in practice)

    def feed(self, text: str, *, last: bool = False) -> ParsedDelta:
        self._out: list[ToolCallDelta] = []
        for char in text:
            self._char(char)
        return ParsedDelta(tool_calls=tuple(self._out))

    def _arguments(self, text: str) -> None:
        if self._name is None:
            self._held += text
        elif self._out and self._out[-1].index == self.calls - 1:
            self._out[-1] = dataclasses.replace(self._out[-1], arguments=self._out[-1].arguments + text)
        else:
            self._out.append(ToolCallDelta(self.calls - 1, arguments=text))

    def _char(self, char: str) -> None:
        element = self._depth == 2  # directly inside an element's object
        if self._in_string:
            if self._in_arguments:
                self._arguments(char)
            elif element:
                self._string += char
            if self._escaped:
                self._escaped = False
            elif char == "\\":
                self._escaped = True
            elif char == '"':
                self._in_string = False
                if element and not self._in_arguments:
                    self._string_read(json.loads(self._string))
            return
        if self._in_arguments and element and char in ",}":
            self._in_arguments = False  # the value ended: the char is the element's
        if char == '"':
            self._in_string = True
            self._string = char
        elif char in "[{":
            self._depth += 1
            if self._depth == 2:
                self._key, self._name, self._held = None, None, ""
        elif char in "]}":
            self._depth -= 1
        elif char == ":" and element and not self._in_arguments:
            self._in_arguments = self._key == "parameters"
            return
        elif char == "," and element:
            self._key = None
        if self._in_arguments and not (element and char.isspace()):
            self._arguments(char)

    def _string_read(self, value: Any) -> None:
        if self._key is None:
            self._key = value
        elif self._key == "name" and isinstance(value, str):
            self._name, held, self._held = value, self._held, ""
            self._out.append(ToolCallDelta(self.calls, openai_call_id(), value, held))
            self.calls += 1
