"""Tool calling in /v1/chat/completions against the real OpenAI client, over the embedded model: the tools and the
tool history reach the chat template, the refusals, and the model's text read for calls (--tool-call-parser) with
and without streaming. The embedded model's weights are random, so the parse path replaces the text it generates
with a known one (ScriptedText); everything else (tokens, finish, streaming) is the engine's."""

from __future__ import annotations

import contextlib
import json
import re

import openai
import pytest

from omnirun.engine import LLM
from omnirun.errors import ConfigError
from omnirun.server.app import create_app
from omnirun.server.testing import ScriptedText, running_server, script_pieces

MODEL = "tiny"
FLAGS = {"device": "cpu", "dtype": "float32", "max_total_tokens": 8192}

# The embedded model's template ignores tools: this one (ChatML-like, its own special tokens) shows them, a tool
# call's arguments through `tojson` (as Qwen's and Llama's templates write them) and a tool message's call id.
TOOLS_TEMPLATE = """
{%- if tools %}<s>system
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</s>
{% endif %}
{%- for message in messages %}<s>{{ message.role }}
{% if message.tool_calls %}{% for call in message.tool_calls -%}
<tool_call>{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}</tool_call>
{% endfor %}{% elif message.role == "tool" %}[{{ message.tool_call_id }}] {{ message.content }}
{% else %}{{ message.content }}
{% endif %}</s>
{% endfor %}{% if add_generation_prompt %}<s>assistant
{% endif %}"""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]
ASK = [{"role": "user", "content": "Weather in Paris?"}]

WEATHER = ("get_weather", {"city": "Paris", "note": 'a "quoted" {brace}'})
TIME = ("get_time", {"zone": "CET", "nested": {"list": [1, {"x": "]"}]}})


def _json(call, key="arguments") -> str:
    return json.dumps({"name": call[0], key: call[1]})


# What each format's model would write for "check the weather and the time": (text, content, calls).
SCRIPTS = {
    "hermes": (
        f"Checking.\n<tool_call>\n{_json(WEATHER)}\n</tool_call>\n<tool_call>\n{_json(TIME)}\n</tool_call>",
        "Checking.\n",
        [WEATHER, TIME],
    ),
    "llama3_json": (f"{_json(WEATHER, 'parameters')}; {_json(TIME, 'parameters')}", None, [WEATHER, TIME]),
    "mistral": (f"Checking. [TOOL_CALLS] [{_json(WEATHER)}, {_json(TIME)}]", "Checking. ", [WEATHER, TIME]),
}
CALL_ID = {"hermes": r"call_[0-9a-f]{24}", "llama3_json": r"call_[0-9a-f]{24}", "mistral": r"[A-Za-z0-9]{9}"}


@pytest.fixture(scope="module")
def llm():
    with LLM(**FLAGS) as llm:
        llm.tokenizer.chat_template = TOOLS_TEMPLATE
        yield llm


@contextlib.contextmanager
def serving(llm, parser: str | None = None, script: str | None = None):
    """A server over `llm` (with `--tool-call-parser parser`), whose model says `script` when one is given; yields
    an OpenAI client."""
    app = create_app(llm, served_model_name=MODEL, tool_call_parser=parser)
    if script is not None:
        engine = app.state.server.engine
        engine.submit = ScriptedText(engine.submit, script)
    with running_server(app) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def _prompt_tokens(llm, messages, tools=None) -> int:
    text = llm.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    return len(llm.tokenizer(text, add_special_tokens=False).input_ids)


def test_the_tools_reach_the_chat_template(llm):
    with serving(llm, "hermes") as client:
        out = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=1)
    assert out.usage.prompt_tokens == _prompt_tokens(llm, ASK, TOOLS)
    assert out.usage.prompt_tokens > _prompt_tokens(llm, ASK) + 40  # the tools' schemas are in the prompt


def test_tool_calls_and_tool_results_go_back_through_the_template_as_hf_expects(llm):
    arguments = {"city": "Paris"}
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, clear"},
    ]
    with serving(llm, "hermes") as client:
        out = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=1)
    as_hf = [*history[:1], {**history[1], "content": ""}, history[2]]
    as_hf[1]["tool_calls"] = [
        {**history[1]["tool_calls"][0], "function": {"name": "get_weather", "arguments": arguments}}
    ]
    assert out.usage.prompt_tokens == _prompt_tokens(llm, as_hf, TOOLS)
    # (the template tells the forms apart: arguments passed as the JSON string, or the call id left out)
    assert out.usage.prompt_tokens != _prompt_tokens(llm, [*history[:2], history[2]], TOOLS)
    no_id = [*as_hf[:2], {"role": "tool", "content": "18 C, clear"}]
    assert out.usage.prompt_tokens != _prompt_tokens(llm, no_id, TOOLS)


def _scripted_request(text: str) -> dict:
    """The arguments of a request whose model says `text` (see ScriptedText)."""
    steps = len(script_pieces(text))
    return {"model": MODEL, "messages": ASK, "tools": TOOLS, "max_tokens": steps, "extra_body": {"ignore_eos": True}}


def _calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


@pytest.mark.parametrize("parser", sorted(SCRIPTS))
def test_calls_in_the_output_become_tool_calls(llm, parser):
    text, content, calls = SCRIPTS[parser]
    with serving(llm, parser, text) as client:
        out = client.chat.completions.create(**_scripted_request(text), n=2)
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content == content
        assert _calls(choice.message) == calls and all(c.type == "function" for c in choice.message.tool_calls)
        assert all(re.fullmatch(CALL_ID[parser], c.id) for c in choice.message.tool_calls)
    ids = [c.id for choice in out.choices for c in choice.message.tool_calls]
    assert len(set(ids)) == len(ids) == 2 * len(calls)


@pytest.mark.parametrize("parser", sorted(SCRIPTS))
def test_streamed_tool_calls_assemble_into_the_same_message(llm, parser):
    text, content, calls = SCRIPTS[parser]
    with serving(llm, parser, text) as client:
        with client.chat.completions.stream(**_scripted_request(text), n=2) as stream:
            chunks = [event.chunk for event in stream if event.type == "chunk"]
            final = stream.get_final_completion()
    for choice in final.choices:  # put together by the client's own accumulator
        assert choice.finish_reason == "tool_calls" and (choice.message.content or None) == content
        assert _calls(choice.message) == calls
        assert all(re.fullmatch(CALL_ID[parser], c.id) and c.type == "function" for c in choice.message.tool_calls)
    pieces = [(c.choices[0].index, d) for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    for index in (0, 1):  # each call's name and id come once, in its first piece
        named = [d.index for i, d in pieces if i == index and d.function.name is not None]
        assert named == list(range(len(calls))) == [d.index for i, d in pieces if i == index and d.id is not None]


def test_without_tool_choice_auto_the_text_stays_content(llm):
    text = SCRIPTS["hermes"][0]
    with serving(llm, "hermes", text) as client:
        out = client.chat.completions.create(**_scripted_request(text), tool_choice="none")
    assert out.choices[0].message.content == text and out.choices[0].message.tool_calls is None
    assert out.choices[0].finish_reason == "length"
    with serving(llm, None, text) as client:  # no parser: tools may still be sent, with tool_choice none
        stream = client.chat.completions.create(**_scripted_request(text), tool_choice="none", stream=True)
        chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert not any(c.choices[0].delta.tool_calls for c in chunks) and chunks[-1].choices[0].finish_reason == "length"


def test_what_needs_a_parser_or_names_no_tool_is_refused_in_one_line(llm):
    with serving(llm) as client:
        with pytest.raises(openai.BadRequestError, match="--tool-call-parser") as info:
            client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS)  # tool_choice auto, by default
        assert info.value.body["param"] == "tool_choice"
    with serving(llm, "hermes") as client:
        # (required and a named function are enforced by the grammar: test_server_structured.py)
        choice = {"type": "function", "function": {"name": "get_date"}}
        with pytest.raises(openai.BadRequestError, match="tool_choice names 'get_date', which is not in tools") as info:
            client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice)
        assert "\n" not in info.value.body["message"] and info.value.body["param"] == "tool_choice"
        with pytest.raises(openai.BadRequestError, match="tool_choice needs tools"):
            client.chat.completions.create(model=MODEL, messages=ASK, tool_choice="auto")
        bad = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "{zone: CET}"}}
        history = [*ASK, {"role": "assistant", "tool_calls": [bad]}]
        with pytest.raises(openai.BadRequestError, match=r"messages\[1\].tool_calls\[0\].function.arguments"):
            client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS)
        assert client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=2).choices
    with pytest.raises(ConfigError, match="no tool call parser 'qwen'"):
        create_app(llm, tool_call_parser="qwen")


def test_output_without_calls_stays_content_through_the_parser(llm):
    text = "No call: 1 < 2, <b>bold</b> and a {brace}."
    with serving(llm, "hermes", text) as client:
        out = client.chat.completions.create(**_scripted_request(text))
        chunks = list(client.chat.completions.create(**_scripted_request(text), stream=True))
    assert (out.choices[0].message.content, out.choices[0].message.tool_calls) == (text, None)
    assert out.choices[0].finish_reason == "length" == chunks[-1].choices[0].finish_reason
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text


@pytest.mark.parametrize("parser, keeps", [("mistral", True), ("hermes", False), (None, False)])
def test_a_parser_whose_marker_is_a_special_token_keeps_special_tokens_in_the_text(llm, parser, keeps):
    """Mistral's [TOOL_CALLS] is a special token, which the detokenizer skips by default: the request it parses keeps
    them (tests/test_detokenizer.py checks that the text then holds them)."""
    seen = []
    app = create_app(llm, served_model_name=MODEL, tool_call_parser=parser)
    engine = app.state.server.engine
    submit = engine.submit
    engine.submit = lambda requests: seen.extend(r.params for r in requests) or submit(requests)
    with running_server(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        extra = {"tools": TOOLS} if parser else {}
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2, **extra)
    assert [p.skip_special_tokens for p in seen] == [not keeps]


def _assert_arguments_stream_in_pieces(llm, parser: str) -> None:
    """The first call's arguments reach the client in several chunks, and the chunks assemble into the message."""
    text, _, calls = SCRIPTS[parser]
    with serving(llm, parser, text) as client:
        with client.chat.completions.stream(**_scripted_request(text)) as stream:
            chunks = [event.chunk for event in stream if event.type == "chunk"]
            final = stream.get_final_completion()
    pieces = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or [] if d.index == 0]
    assert len([d for d in pieces if d.function.arguments]) > 1
    assert json.loads("".join(d.function.arguments or "" for d in pieces)) == calls[0][1]
    assert _calls(final.choices[0].message) == calls


def test_auto_calls_under_the_grammar_stream_their_arguments_in_pieces(llm):
    """hermes has a structural tag: its `auto` calls run under the grammar, so a call's arguments are sent as they
    come (several pieces)."""
    _assert_arguments_stream_in_pieces(llm, "hermes")


@pytest.mark.parametrize("parser", ["llama3_json", "mistral"])
def test_calls_read_without_a_grammar_stream_their_arguments_in_pieces_too(llm, parser):
    """llama3_json and mistral read unconstrained text: a call is sent once its header is read, its arguments as
    they come."""
    _assert_arguments_stream_in_pieces(llm, parser)
