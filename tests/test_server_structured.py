"""Structured output and enforced tool choice through the server, against the real openai client over the embedded
model (whose random weights would never write JSON unconstrained): response_format, vLLM's structured_outputs and
guided_* fields, tool_choice required / named in chat (streamed and not), and /v1/responses text.format and forced
function calls. Schemas are bounded (maxLength, enums, integer ranges) so that the random model always finishes."""

from __future__ import annotations

import contextlib
import json
import random
import re

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response
from pydantic import BaseModel, Field

pytest.importorskip("xgrammar", reason="structured output needs xgrammar (pip install 'omnirun[structured]')")

from omnirun.engine import LLM  # noqa: E402
from omnirun.engine.process import EngineProcess  # noqa: E402
from omnirun.server.app import create_app  # noqa: E402
from omnirun.server.structured import CallArrayStream  # noqa: E402
from omnirun.server.testing import running_server  # noqa: E402

MODEL = "tiny"
FLAGS = {"device": "cpu", "dtype": "float32", "max_total_tokens": 16384}
ASK = [{"role": "user", "content": "Answer in JSON."}]

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["CET", "UTC"]}, "offset": {"type": "integer", "minimum": -12, "maximum": 12}},
    "required": ["zone"],
    "additionalProperties": False,
}
# A tool whose schema refers to its own $defs: in `required`'s array schema they move to the root.
PAINT = {
    "$defs": {"color": {"enum": ["red", "green"]}},
    "type": "object",
    "properties": {"color": {"$ref": "#/$defs/color"}},
    "required": ["color"],
    "additionalProperties": False,
}
PARAMETERS = {"get_weather": WEATHER, "get_time": TIME, "paint": PAINT}
TOOLS = [{"type": "function", "function": {"name": name, "parameters": schema}} for name, schema in PARAMETERS.items()]
RESPONSES_TOOLS = [{"type": "function", "name": name, "parameters": schema} for name, schema in PARAMETERS.items()]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


# The embedded model's template ignores tools: this one names them (their schemas would take most of its context of
# 1024 tokens) and shows a call's arguments and a tool message's call id.
TOOLS_TEMPLATE = """{%- if tools %}<s>system
{% for tool in tools %}{{ tool.function.name }}
{% endfor %}</s>
{% endif %}{%- for message in messages %}<s>{{ message.role }}
{% if message.tool_calls %}{% for call in message.tool_calls -%}
<tool_call>{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}</tool_call>
{% endfor %}{% elif message.role == "tool" %}[{{ message.tool_call_id }}] {{ message.content }}
{% else %}{{ message.content }}
{% endif %}</s>
{% endfor %}{% if add_generation_prompt %}<s>assistant
{% endif %}"""


class Person(BaseModel):
    name: str = Field(max_length=6)
    age: int = Field(ge=0, le=120)


@pytest.fixture(scope="module")
def llm():
    with LLM(**FLAGS) as llm:
        llm.tokenizer.chat_template = TOOLS_TEMPLATE
        yield llm


@contextlib.contextmanager
def serving(engine, **flags):
    with running_server(create_app(engine, served_model_name=MODEL, **flags)) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def url(llm):
    with running_server(create_app(llm, served_model_name=MODEL)) as url:
        yield url


@pytest.fixture
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def _calls(message) -> list[tuple[str, str]]:
    return [(call.function.name, call.function.arguments) for call in message.tool_calls or []]


def _validate_calls(calls: list[tuple[str, str]]) -> None:
    assert calls
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), PARAMETERS[name])


# --- response_format and vLLM's fields ---


@pytest.mark.parametrize("where", ["thread", "process"])  # the engine in this process, or in one of its own
def test_response_format_json_schema_content_parses_and_validates(llm, where):
    engine = contextlib.nullcontext(llm) if where == "thread" else EngineProcess(**FLAGS)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    with engine as engine, serving(engine) as client:
        out = client.chat.completions.create(
            model=MODEL, messages=ASK, response_format=fmt, max_tokens=300, n=3, seed=1, temperature=1.0
        )
    for choice in out.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_chat_completions_parse_returns_the_pydantic_object(client):
    out = client.chat.completions.parse(
        model=MODEL, messages=ASK, response_format=Person, max_tokens=300, seed=2, temperature=1.0
    )
    person = out.choices[0].message.parsed
    assert isinstance(person, Person) and person == Person.model_validate_json(out.choices[0].message.content)


def test_response_format_json_object_gives_a_json_object(llm, client):
    # Any object has unbounded strings: a bias towards closing them lets the random model finish one.
    closing = {str(llm.tokenizer.convert_tokens_to_ids(t)): 6.0 for t in ('"', "}")}
    out = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        response_format={"type": "json_object"},
        max_tokens=300,
        seed=3,
        temperature=1.0,
        logit_bias=closing,
    )
    assert out.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(out.choices[0].message.content), dict)


COMPLETIONS = [
    # (the body's extra fields, what the text must match)
    ({"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2,4}"}}, r"[0-9]{3}-[a-z]{2,4}"),
    ({"structured_outputs": {"choice": ["yes", "no way", 'say "hi"']}}, r'yes|no way|say "hi"'),
    ({"structured_outputs": {"grammar": 'root ::= "(" [1-9] ("+" [1-9])* ")"'}}, r"\([1-9](\+[1-9])*\)"),
    ({"guided_regex": "[a-c]{5}"}, "[a-c]{5}"),
    ({"guided_choice": ["left", "right"]}, "left|right"),
    ({"guided_json": SCHEMA}, SCHEMA),
    ({"structured_outputs": {"json": SCHEMA}}, SCHEMA),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}}, SCHEMA),
]


@pytest.mark.parametrize("extra, expected", COMPLETIONS, ids=[next(iter(e)) for e, _ in COMPLETIONS])
def test_completions_constraints_match(client, extra, expected):
    for stream in (False, True):
        kw = {"model": MODEL, "prompt": "Go:", "max_tokens": 300, "seed": 4, "temperature": 1.0, "extra_body": extra}
        if stream:
            chunks = list(client.completions.create(**kw, stream=True))
            text, finish = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
        else:
            out = client.completions.create(**kw)
            text, finish = out.choices[0].text, out.choices[0].finish_reason
        assert finish == "stop", text
        if isinstance(expected, dict):
            jsonschema.validate(json.loads(text), expected)
        else:
            assert re.fullmatch(expected, text), text


TWO_CONSTRAINTS = [
    ({"structured_outputs": {"json": SCHEMA, "regex": "a+"}}, "structured_outputs.json and structured_outputs.regex"),
    ({"guided_json": SCHEMA, "response_format": {"type": "json_object"}}, "response_format and guided_json"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_regex and guided_choice"),
    ({"tools": TOOLS, "tool_choice": NAMED, "guided_regex": "a"}, "guided_regex and tool_choice naming 'get_weather'"),
]


@pytest.mark.parametrize("extra, names", TWO_CONSTRAINTS, ids=[n for _, n in TWO_CONSTRAINTS])
def test_two_constraints_are_a_one_line_400_naming_them(client, extra, names):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=ASK, extra_body=extra)
    message = info.value.body["message"]
    assert message == f"{names} each constrain the output: send only one"
    if "tools" not in extra:  # completions take the same fields
        with pytest.raises(openai.BadRequestError, match=re.escape(names)):
            client.completions.create(model=MODEL, prompt="x", extra_body=extra)


BAD = [
    ({"guided_json": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}, "json schema"),
    ({"structured_outputs": {"regex": "[a-"}}, "regex"),
    ({"guided_grammar": "root ::= missing_rule"}, "ebnf"),
]


@pytest.mark.parametrize("extra, kind", BAD, ids=[k for _, k in BAD])
def test_a_constraint_that_does_not_compile_is_a_400_with_its_one_line(client, extra, kind):
    for create in (
        lambda: client.chat.completions.create(model=MODEL, messages=ASK, extra_body=extra),
        lambda: client.completions.create(model=MODEL, prompt="x", extra_body=extra),
    ):
        with pytest.raises(openai.BadRequestError) as info:
            create()
        message = info.value.body["message"]
        assert re.fullmatch(f"cannot compile the {kind} constraint: .+; fix it or drop it", message), message
        assert "\n" not in message
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=2).choices  # the server goes on


def test_bad_constraint_fields_are_one_line_400s(client):
    cases = [
        ({"response_format": {"type": "json_schema"}}, "response_format json_schema needs json_schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format has no schema"),
        ({"guided_choice": []}, "a choice needs a non-empty list"),
        ({"guided_json": "{not json"}, "the JSON schema is not JSON"),
        ({"structured_outputs": {"structural_tag": {"x": 1}}}, "structural_tag is not supported"),
    ]
    for extra, words in cases:
        with pytest.raises(openai.BadRequestError, match=re.escape(words)) as info:
            client.chat.completions.create(model=MODEL, messages=ASK, extra_body=extra)
        assert "\n" not in info.value.body["message"]


# --- tool_choice required and named, in chat ---


def _forced(client, tool_choice, *, stream: bool, seed: int, **kw):
    """The message and finish reason of a forced tool choice; streamed, as the SDK's accumulator assembles it, with
    the argument pieces each call got."""
    args = {"model": MODEL, "messages": ASK, "tools": TOOLS, "tool_choice": tool_choice, "max_tokens": 400}
    args.update(seed=seed, temperature=1.0, **kw)
    if not stream:
        out = client.chat.completions.create(**args)
        return out.choices[0].message, out.choices[0].finish_reason, None
    with client.chat.completions.stream(**args) as events:
        chunks = [event.chunk for event in events if event.type == "chunk"]
        final = events.get_final_completion()
    pieces = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    return final.choices[0].message, final.choices[0].finish_reason, pieces


def test_tool_choice_required_calls_validate_against_their_tools(client):
    names = set()
    for seed in range(6):
        message, finish, _ = _forced(client, "required", stream=False, seed=seed)
        assert finish == "tool_calls" and message.content is None
        _validate_calls(_calls(message))
        assert all(re.fullmatch(r"call_[0-9a-f]{24}", call.id) for call in message.tool_calls)
        names |= {name for name, _ in _calls(message)}
    assert len(names) > 1  # the model picks among the tools


def test_tool_choice_required_with_parallel_tool_calls_false_makes_one_call(client):
    for seed in range(4):
        message, finish, _ = _forced(client, "required", stream=False, seed=seed, parallel_tool_calls=False)
        assert finish == "tool_calls" and len(message.tool_calls) == 1
        _validate_calls(_calls(message))


def test_tool_choice_named_returns_one_call_of_that_function(client):
    for seed in range(3):
        message, finish, _ = _forced(client, NAMED, stream=False, seed=seed)
        assert finish == "stop"  # vLLM's (and OpenAI's) for a named function; "tool_calls" is required's
        [(name, _)] = _calls(message)
        assert name == "get_weather"
        _validate_calls(_calls(message))


@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
def test_streamed_forced_calls_assemble_into_the_non_streamed_message(client, tool_choice):
    for seed in (7, 8):
        message, finish, _ = _forced(client, tool_choice, stream=False, seed=seed)
        streamed, streamed_finish, pieces = _forced(client, tool_choice, stream=True, seed=seed)
        assert (streamed_finish, _calls(streamed), streamed.content) == (finish, _calls(message), None)
        assert all(
            re.fullmatch(r"call_[0-9a-f]{24}", call.id) and call.type == "function" for call in streamed.tool_calls
        )
        for index, (_, arguments) in enumerate(_calls(message)):  # the arguments come in pieces, as produced
            own = [p for p in pieces if p.index == index]
            assert [p.function.name for p in own if p.function.name] == [message.tool_calls[index].function.name]
            assert len([p for p in own if p.function.arguments]) > 1
            assert "".join(p.function.arguments or "" for p in own) == arguments


def test_forced_calls_cut_by_max_tokens_end_with_length_in_both(client):
    message, finish, _ = _forced(client, NAMED, stream=False, seed=1, max_tokens=4)
    streamed_chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=TOOLS,
            tool_choice=NAMED,
            max_tokens=4,
            seed=1,
            temperature=1.0,
            stream=True,
        )
    )
    assert finish == "length" == streamed_chunks[-1].choices[0].finish_reason
    streamed = "".join(d.function.arguments or "" for c in streamed_chunks for d in c.choices[0].delta.tool_calls or [])
    assert streamed == message.tool_calls[0].function.arguments  # the arguments so far, in both


def test_forced_tool_choice_needs_no_parser_and_overrides_one(llm):
    with serving(llm, tool_call_parser="hermes") as client:
        message, finish, _ = _forced(client, NAMED, stream=False, seed=0)
    assert finish == "stop" and [name for name, _ in _calls(message)] == ["get_weather"]


def test_a_named_function_that_is_not_in_tools_is_a_400(client):
    choice = {"type": "function", "function": {"name": "nope"}}
    with pytest.raises(openai.BadRequestError, match="tool_choice names 'nope', which is not in tools"):
        client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice)


def test_the_call_array_reader_gives_the_same_calls_however_the_text_is_cut():
    calls = [
        # an escaped quote before a brace, an escaped backslash before a closing quote
        ("get_weather", '{"city": "a \\" }{", "unit": "C\\\\"}'),
        ("paint", '{"color": "red", "nested": {"list": [1, {"x": "]"}]}}'),
        ("get_time", "{}"),
    ]
    text = "[" + ", ".join(f'{{"name": {json.dumps(n)}, "parameters": {a}}}' for n, a in calls) + "]"
    rng = random.Random(0)
    for _ in range(50):
        reader, pieces, at = CallArrayStream(), [], 0
        while at < len(text):
            size = rng.randint(1, 5)
            pieces += reader.feed(text[at : at + size]).tool_calls
            at += size
        assembled: list[list[str]] = []
        for piece in pieces:
            if piece.id is not None:
                assembled.append([piece.name, ""])
            assembled[piece.index][1] += piece.arguments
        assert [tuple(call) for call in assembled] == calls


# --- /v1/responses ---


def test_responses_text_format_json_schema_validates(client, url):
    fmt = {"type": "json_schema", "name": "person", "schema": SCHEMA, "strict": True}
    out = client.responses.create(model=MODEL, input="JSON", text={"format": fmt}, max_output_tokens=300, temperature=0)
    assert out.status == "completed"
    jsonschema.validate(json.loads(out.output_text), SCHEMA)
    assert out.text.format.type == "json_schema" and out.text.format.name == "person"
    parsed = client.responses.parse(
        model=MODEL, input="JSON", text_format=Person, max_output_tokens=300, temperature=1.0, extra_body={"seed": 5}
    )
    assert isinstance(parsed.output_parsed, Person)
    with client.responses.stream(
        model=MODEL, input="JSON", text={"format": fmt}, max_output_tokens=300, temperature=0
    ) as stream:
        streamed = "".join(event.delta for event in stream if event.type == "response.output_text.delta")
    assert streamed == out.output_text  # (greedy: the same text)
    obj = client.responses.create(
        model=MODEL, input="JSON", text={"format": {"type": "json_object"}}, max_output_tokens=300
    )
    assert obj.status == "completed" and isinstance(json.loads(obj.output_text), dict)


def _responses_call(client, tool_choice, *, stream: bool, seed: int):
    args = {"model": MODEL, "input": "Call.", "tools": RESPONSES_TOOLS, "tool_choice": tool_choice}
    args.update(max_output_tokens=400, temperature=1.0, extra_body={"seed": seed})
    if not stream:
        return client.responses.create(**args), None
    with client.responses.stream(**args) as events:
        seen = list(events)
        return events.get_final_response(), seen


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "name": "get_weather"}], ids=["required", "named"]
)
def test_responses_forced_tool_choice_returns_function_calls_streamed_and_not(client, url, tool_choice):
    for seed in (1, 2):
        out, _ = _responses_call(client, tool_choice, stream=False, seed=seed)
        streamed, events = _responses_call(client, tool_choice, stream=True, seed=seed)
        calls = [(item.name, item.arguments) for item in out.output]
        assert all(item.type == "function_call" and item.status == "completed" for item in out.output)
        assert all(item.call_id.startswith("call_") and item.id.startswith("fc_") for item in out.output)
        _validate_calls(calls)
        if isinstance(tool_choice, dict):
            assert [name for name, _ in calls] == ["get_weather"]
        assert out.status == streamed.status == "completed"
        assert [(item.name, item.arguments) for item in streamed.output] == calls
        # the events: each call added, its arguments in pieces, done; then the whole response
        types = [event.type for event in events]
        assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
        for index, item in enumerate(streamed.output):
            own = [e for e in events if getattr(e, "output_index", None) == index]
            assert own[0].type == "response.output_item.added" and own[0].item.arguments == ""
            deltas = [e.delta for e in own if e.type == "response.function_call_arguments.delta"]
            assert len(deltas) > 1 and "".join(deltas) == item.arguments
            assert [e.type for e in own[-2:]] == ["response.function_call_arguments.done", "response.output_item.done"]
            assert own[-2].arguments == item.arguments and own[-1].item.id == own[0].item.id == item.id
    raw = httpx.post(
        f"{url}/v1/responses",
        json={"input": "x", "tools": RESPONSES_TOOLS, "tool_choice": tool_choice, "max_output_tokens": 400},
    )
    Response.model_validate(raw.json())  # every field the SDK's Response requires


def test_responses_function_calls_and_their_outputs_go_back_through_the_template(llm, client):
    history = [
        {"role": "user", "content": "Weather?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "18 C"},
    ]
    out = client.responses.create(model=MODEL, input=history, tools=RESPONSES_TOOLS, tool_choice="none")
    messages = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "content": "18 C", "tool_call_id": "call_1"},
    ]
    tools = [{"type": "function", "function": {"name": n, "parameters": p}} for n, p in PARAMETERS.items()]

    def tokens(messages) -> int:
        text = llm.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
        return len(llm.tokenizer(text, add_special_tokens=False).input_ids)

    assert out.usage.input_tokens == tokens(messages)
    assert out.usage.input_tokens != tokens([messages[0], {**messages[1], "tool_calls": []}, messages[2]])


RESPONSES_REFUSED = [
    ({"tools": RESPONSES_TOOLS}, "tool_choice 'auto' (the default with tools)", "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice needs tools", "tool_choice"),
    ({"tools": [{"type": "web_search"}], "tool_choice": "required"}, "only function tools", "tools"),
    ({"tools": RESPONSES_TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "not in tools", "tool_choice"),
    (
        {"tools": RESPONSES_TOOLS, "tool_choice": "required", "text": {"format": {"type": "json_object"}}},
        "text.format and tool_choice 'required' each constrain the output",
        "tool_choice",
    ),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format has no schema", "text.format"),
    (
        {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}},
        "cannot compile the json schema constraint",
        None,
    ),
]


@pytest.mark.parametrize("fields, words, param", RESPONSES_REFUSED, ids=[w for _, w, _ in RESPONSES_REFUSED])
def test_responses_refusals_are_one_line_400s(client, fields, words, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, input="x", **fields)
    error = info.value.body
    assert words in error["message"] and "\n" not in error["message"] and error["param"] == param
