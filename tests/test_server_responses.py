"""POST /v1/responses against the real openai client: a real uvicorn server on a free port over the embedded model
(engine in a thread of this process); its text is compared with the same greedy request through /v1/chat/completions,
which templates the same messages."""

from __future__ import annotations

import contextlib
import json
import re
import time

import httpx
import openai
import pytest
from openai.types.responses import Response

from omnirun.engine import LLM
from omnirun.errors import EngineStepError
from omnirun.server.app import create_app
from omnirun.server.testing import ScriptedText, running_server, script_pieces

MODEL = "tiny"
KEY = "test-key"
PROMPT = "Hello, world!"
# The embedded model's greedy text repeats one token ("putput..."); a presence penalty makes it vary, so that a stop
# string can end it partway (status completed) and a wrong token shows in the text.
VARIED = {"presence_penalty": 2.0}
STREAM_ORDER_START = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
]
STREAM_ORDER_END = [
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
    "response.completed",
]


@pytest.fixture(scope="module")
def llm():
    with LLM(device="cpu", dtype="float32", max_total_tokens=16384) as llm:
        yield llm


@pytest.fixture(scope="module")
def url(llm):
    with running_server(create_app(llm, served_model_name=MODEL, api_key=KEY)) as url:
        yield url


@pytest.fixture
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)


def _chat(client, messages, **kw):
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kw)


def _pool_whole_within(engine, seconds: float) -> float:
    """Wait until every KV page is free (or only cached) and no request is live; returns how long that took."""
    start = time.monotonic()
    while True:
        usage = engine.kv_usage()
        if usage.pages_free + usage.pages_cached == usage.pages_total and not usage.pages_held:
            return time.monotonic() - start
        if time.monotonic() - start > seconds:
            raise AssertionError(f"KV pages not all back after {seconds} s: {usage}")
        time.sleep(0.02)


def _auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}"}


def _sse_events(text: str) -> list[tuple[str, dict]]:
    """(the `event:` line's name, the data's JSON) of each event of a raw SSE body."""
    events = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        events.append((lines["event"], json.loads(lines["data"])))
    return events


def test_a_string_input_completes_with_the_text_of_the_same_greedy_chat_request(client, url):
    messages = [{"role": "user", "content": PROMPT}]
    whole = _chat(client, messages, max_tokens=16, **VARIED).choices[0].message.content
    stop = re.findall(r"[a-z]{3,}", whole)[-1]  # a word late in the text: the stop ends it partway
    chat = _chat(client, messages, max_tokens=16, stop=[stop], **VARIED)
    assert chat.choices[0].finish_reason == "stop" and chat.choices[0].message.content, chat

    out = client.responses.create(
        model=MODEL,
        input=PROMPT,
        temperature=0,
        max_output_tokens=16,
        metadata={"run": "test"},
        user="tester",
        extra_body={"stop": [stop], **VARIED},
    )
    assert out.output_text == chat.choices[0].message.content
    assert out.status == "completed" and out.incomplete_details is None and out.completed_at >= out.created_at
    assert out.id.startswith("resp_") and out.object == "response" and out.model == MODEL
    [message] = out.output
    assert (message.type, message.role, message.status) == ("message", "assistant", "completed")
    assert message.id.startswith("msg_")
    assert [(part.type, part.annotations) for part in message.content] == [("output_text", [])]
    assert (out.usage.input_tokens, out.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert out.usage.total_tokens == chat.usage.total_tokens
    assert out.usage.output_tokens_details.reasoning_tokens == 0
    assert (out.temperature, out.top_p, out.max_output_tokens) == (0, 1, 16)
    assert (out.metadata, out.user, out.tools, out.tool_choice) == ({"run": "test"}, "tester", [], "auto")

    # the body holds every field the SDK's Response requires (the client itself builds it without checking)
    raw = httpx.post(f"{url}/v1/responses", json={"input": PROMPT, "max_output_tokens": 2}, headers=_auth())
    Response.model_validate(raw.json())


def test_messages_with_instructions_equal_chat_with_a_system_message_first(client):
    history = [
        {"role": "user", "content": [{"type": "input_text", "text": "Hello,"}, {"type": "input_text", "text": " you"}]},
        # an earlier response's output, sent back as the conversation so far (nothing is kept on the server)
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "put", "annotations": []}],
        },
        {"role": "developer", "content": "Answer in French."},
        {"role": "user", "content": "Again?"},
    ]
    chat_messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello, you"},
        {"role": "assistant", "content": "put"},
        {"role": "developer", "content": "Answer in French."},
        {"role": "user", "content": "Again?"},
    ]
    chat = _chat(client, chat_messages, max_tokens=10, **VARIED)
    out = client.responses.create(
        model=MODEL, input=history, instructions="Be brief.", temperature=0, max_output_tokens=10, extra_body=VARIED
    )
    assert out.output_text == chat.choices[0].message.content
    assert out.usage.input_tokens == chat.usage.prompt_tokens  # the same templated prompt, token for token
    assert out.instructions == "Be brief."


def test_a_small_max_output_tokens_makes_the_response_incomplete_at_that_many_tokens(client):
    chat = _chat(client, [{"role": "user", "content": PROMPT}], max_tokens=3)
    out = client.responses.create(model=MODEL, input=PROMPT, temperature=0, max_output_tokens=3)
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert out.usage.output_tokens == 3 and out.output[0].status == "incomplete" and out.completed_at is None
    assert out.output_text == chat.choices[0].message.content


def test_a_stream_sends_the_events_in_order_and_its_deltas_make_the_unstreamed_text(client):
    kw = {"model": MODEL, "input": PROMPT, "temperature": 0, "max_output_tokens": 12, "extra_body": VARIED}
    unstreamed = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))

    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) >= 2  # text as the engine produces it, not all at the end
    assert [e.type for e in events] == STREAM_ORDER_START + [d.type for d in deltas] + STREAM_ORDER_END
    assert [e.sequence_number for e in events] == list(range(len(events)))

    created, in_progress, added, part_added = events[:4]
    text_done, part_done, item_done, completed = events[-4:]
    text = "".join(d.delta for d in deltas)
    assert text == text_done.text == part_done.part.text == completed.response.output_text == unstreamed.output_text
    assert created.response.status == in_progress.response.status == "in_progress" and created.response.output == []
    item_id = added.item.id
    assert {e.item_id for e in (part_added, *deltas, text_done, part_done)} == {item_id}
    assert item_done.item.id == completed.response.output[0].id == item_id
    assert created.response.id == completed.response.id
    assert completed.response.status == unstreamed.status == "incomplete"
    assert completed.response.usage.output_tokens == unstreamed.usage.output_tokens == 12


def test_each_stream_event_names_its_type_on_its_event_line(url):
    body = {"model": MODEL, "input": PROMPT, "max_output_tokens": 4, "stream": True}
    raw = httpx.post(f"{url}/v1/responses", json=body, headers=_auth())
    assert raw.headers["content-type"].startswith("text/event-stream")
    events = _sse_events(raw.text)
    assert [name for name, _ in events] == [data["type"] for _, data in events]
    assert events[0][0] == "response.created" and events[-1][0] == "response.completed"


REFUSED = [
    # (fields, words of the message, param)
    ({"previous_response_id": "resp_abc"}, "this server keeps no responses", "previous_response_id"),
    ({"conversation": "conv_abc"}, "keeps no conversations", "conversation"),
    ({"background": True}, "keeps no responses to poll", "background"),
    (  # tools with tool_choice auto on a server without --tool-call-parser (required and named need none)
        {"tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {}}}]},
        "needs a tool call parser: start the server with --tool-call-parser",
        "tool_choice",
    ),
    ({"tool_choice": "required"}, "tool_choice needs tools", "tool_choice"),
    (
        {"input": [{"type": "reasoning", "summary": []}]},
        "only message, function_call and function_call_output",
        "input",
    ),
    ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "needs call_id and output", "input"),
    (
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]},
        "input[0].content[0]: only input_text parts",
        "input",
    ),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role", "input"),
    ({"input": []}, "input is empty", "input"),
    ({"max_output_tokens": "3"}, "max_output_tokens", "max_output_tokens"),  # a wrong type, as chat refuses one
]


@pytest.mark.parametrize("fields, words, param", REFUSED, ids=[words for _, words, _ in REFUSED])
def test_what_is_not_built_or_needs_kept_state_is_a_one_line_400(llm, client, fields, words, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(**{"model": MODEL, "input": PROMPT, **fields})
    error = info.value.body
    assert words in error["message"] and "\n" not in error["message"] and error["param"] == param
    assert client.responses.create(model=MODEL, input=PROMPT, max_output_tokens=2).output_text  # the server goes on
    _pool_whole_within(llm, 1.0)


def test_store_is_accepted_either_way_and_nothing_is_kept(client):
    for store in (True, False):
        out = client.responses.create(model=MODEL, input=PROMPT, max_output_tokens=2, store=store)
        assert out.status == "incomplete" and out.output_text
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(out.id)


def test_unknown_fields_are_ignored_as_chat_ignores_them(client):
    out = client.responses.create(
        model=MODEL, input=PROMPT, temperature=0, max_output_tokens=3, extra_body={"no_such_field": {"x": 1}}
    )
    assert (
        out.output_text == _chat(client, [{"role": "user", "content": PROMPT}], max_tokens=3).choices[0].message.content
    )


def test_another_model_or_a_wrong_key_is_refused(url, client):
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="gpt-4o", input=PROMPT)
    wrong = openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.responses.create(model=MODEL, input=PROMPT)


class _FailsAfterFirstDelta:
    """A request group whose engine fails after the first delta, as a failed engine step ends its requests."""

    def __init__(self, group):
        self._group = group
        self.requests = group.requests

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc_info):
        self._group.abort()

    def abort(self):
        self._group.abort()

    def __aiter__(self):
        return self._deltas()

    async def _deltas(self):
        async for item in self._group:
            yield item
            raise EngineStepError("the engine step failed (planted by the test)")


def test_an_engine_error_mid_stream_ends_it_with_an_error_event_as_chat_streams_do(llm):
    app = create_app(llm, served_model_name=MODEL)
    engine = app.state.server.engine
    submit = engine.submit
    engine.submit = lambda requests: _FailsAfterFirstDelta(submit(requests))
    body = {"model": MODEL, "input": PROMPT, "max_output_tokens": 50, "stream": True}
    with running_server(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        seen = []
        with pytest.raises(openai.APIError, match="planted by the test"):
            for event in client.responses.create(**body):
                seen.append(event.type)
        assert seen[:4] == STREAM_ORDER_START and "response.completed" not in seen
        events = _sse_events(httpx.post(f"{url}/v1/responses", json=body).text)
    name, data = events[-1]
    assert name == "error" and "planted by the test" in data["error"]["message"]
    _pool_whole_within(llm, 1.0)


def test_a_client_that_disconnects_has_its_response_aborted_and_pages_freed(llm, url):
    body = {"model": MODEL, "input": PROMPT, "max_output_tokens": 1000, "ignore_eos": True}
    with httpx.Client(base_url=url, headers=_auth()) as http:
        with http.stream("POST", "/v1/responses", json={**body, "stream": True}) as response:
            lines = response.iter_lines()
            assert next(lines) == "event: response.created"
            assert "event: response.output_text.delta" in lines  # (reads up to the first text)
            assert llm.kv_usage().pages_held, "the request should hold pages while it streams"
        # leaving the block closed the connection mid-stream
        assert _pool_whole_within(llm, 1.0) < 1.0

        with pytest.raises(httpx.ReadTimeout):  # a response not streamed, whose client gives up waiting
            http.post("/v1/responses", json=body, timeout=0.3)
        assert _pool_whole_within(llm, 1.0) < 1.0


# --- tool_choice auto: the model's own calls, read by the server's --tool-call-parser ---

# The embedded model's template ignores tools: this one (as tests/test_server_tools.py's) writes them into the prompt.
TOOLS_TEMPLATE = """
{%- if tools %}<s>system
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</s>
{% endif %}
{%- for message in messages %}<s>{{ message.role }}
{{ message.content }}</s>
{% endfor %}{% if add_generation_prompt %}<s>assistant
{% endif %}"""
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [
    {"type": "function", "name": "get_weather", "description": "The weather in a city", "parameters": WEATHER_SCHEMA},
    {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {}}},
]
WEATHER = ("get_weather", {"city": "Paris", "note": 'a "quoted" {brace} <b>'})
TIME = ("get_time", {"zone": "CET", "nested": {"list": [1, {"x": "]"}]}})


def _hermes(call) -> str:
    return f"<tool_call>\n{json.dumps({'name': call[0], 'arguments': call[1]})}\n</tool_call>"


# (what the model writes, the output items it makes: ("message", text) or ("function_call", (name, arguments)))
CALLS_AFTER_TEXT = (
    f"Checking.\n{_hermes(WEATHER)}\n{_hermes(TIME)}",
    [("message", "Checking.\n"), ("function_call", WEATHER), ("function_call", TIME)],
)
TEXT_AFTER_A_CALL = (
    f"{_hermes(TIME)} Done.",
    [("function_call", TIME), ("message", " Done.")],
)
NO_CALL = ("No call: 1 < 2, <b>bold</b>, <tool_call>not json</tool_call>.", None)


@contextlib.contextmanager
def _serving(llm, parser: str | None, script: str, finish_reason: str = "stop"):
    """A server over `llm` with `--tool-call-parser parser`, whose model says `script` (its template shows tools)
    and ends for `finish_reason`; yields the client and the request's arguments."""
    template, llm.tokenizer.chat_template = llm.tokenizer.chat_template, TOOLS_TEMPLATE
    app = create_app(llm, served_model_name=MODEL, tool_call_parser=parser)
    engine = app.state.server.engine
    engine.submit = ScriptedText(engine.submit, script, finish_reason=finish_reason)  # as a model that ends there
    args = {
        "model": MODEL,
        "input": "Weather in Paris?",
        "tools": TOOLS,
        "max_output_tokens": len(script_pieces(script)),
    }
    args["extra_body"] = {"ignore_eos": True}  # the model says all of the script
    try:
        with running_server(app) as url:
            yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0), args
    finally:
        llm.tokenizer.chat_template = template


def _items(output) -> list[tuple[str, object]]:
    """Output items as ("message", text) or ("function_call", (name, arguments as a dict))."""
    return [
        ("message", "".join(part.text for part in item.content))
        if item.type == "message"
        else ("function_call", (item.name, json.loads(item.arguments)))
        for item in output
    ]


def _prompt_tokens(llm, tools) -> int:
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    text = llm.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    return len(llm.tokenizer(text, add_special_tokens=False).input_ids)


@pytest.mark.parametrize("script, items", [CALLS_AFTER_TEXT, TEXT_AFTER_A_CALL], ids=["text-calls", "call-text"])
def test_auto_tool_choice_reads_the_calls_in_the_text_into_function_call_items(llm, script, items):
    with _serving(llm, "hermes", script) as (client, args):
        out = client.responses.create(**args)  # tool_choice auto: the default with tools
        as_chat = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS]
        assert out.usage.input_tokens == _prompt_tokens(llm, as_chat) > _prompt_tokens(llm, None) + 40  # the tools
    assert _items(out.output) == items and out.status == "completed" and out.tool_choice == "auto"
    assert all(item.status == "completed" for item in out.output)
    calls = [item for item in out.output if item.type == "function_call"]
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", c.call_id) and c.id.startswith("fc_") for c in calls)
    assert len({c.call_id for c in calls}) == len(calls)
    assert [c.arguments for c in calls] == [json.dumps(call[1]) for kind, call in items if kind == "function_call"]


@pytest.mark.parametrize("script, items", [CALLS_AFTER_TEXT, TEXT_AFTER_A_CALL], ids=["text-calls", "call-text"])
def test_auto_tool_choice_streams_events_that_assemble_into_the_same_items(llm, script, items):
    with _serving(llm, "hermes", script) as (client, args):
        events = list(client.responses.create(stream=True, **args))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    completed = events[-1]
    assert completed.type == "response.completed" and completed.response.status == "completed"
    assert _items(completed.response.output) == items  # the SDK's final response

    # the deltas, put together by hand: each item added, filled, done before the next is added (as OpenAI streams)
    mine: list[dict] = []
    for event in events[2:-1]:
        if event.type == "response.output_item.added":
            assert event.output_index == len(mine) and (not mine or mine[-1]["done"])
            mine.append({"item": event.item, "text": "", "arguments": "", "done": False})
            continue
        own = mine[event.output_index]
        assert not own["done"] and getattr(event, "item_id", own["item"].id) == own["item"].id
        if event.type == "response.output_text.delta":
            own["text"] += event.delta
        elif event.type == "response.function_call_arguments.delta":
            own["arguments"] += event.delta
        elif event.type == "response.output_text.done":
            assert event.text == own["text"]
        elif event.type == "response.function_call_arguments.done":
            assert event.arguments == own["arguments"]
        elif event.type == "response.output_item.done":
            own["done"] = True
            assert event.item.id == own["item"].id == completed.response.output[event.output_index].id
    assert all(own["done"] for own in mine)
    assembled = [
        ("message", own["text"]) if own["item"].type == "message" else (own["item"].name, own["arguments"])
        for own in mine
    ]
    assert assembled == [("message", x) if kind == "message" else (x[0], json.dumps(x[1])) for kind, x in items]
    texts = [e for e in events if e.type == "response.output_text.delta"]
    assert len(texts) > 1  # the message's text streams as it comes, not at the end
    # hermes calls run under the grammar's structural tag: their arguments stream in pieces too
    pieces = [e for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(pieces) > 2 * len([kind for kind, _ in items if kind == "function_call"])


def test_text_without_a_call_stays_one_message_through_the_parser(llm):
    script, _ = NO_CALL
    with _serving(llm, "hermes", script) as (client, args):
        out = client.responses.create(**args)
        events = list(client.responses.create(stream=True, **args))
    assert _items(out.output) == _items(events[-1].response.output) == [("message", script)]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == script


def test_tool_choice_none_leaves_the_text_whole_and_needs_no_parser(llm):
    script, _ = CALLS_AFTER_TEXT
    for parser in ("hermes", None):
        with _serving(llm, parser, script) as (client, args):
            out = client.responses.create(tool_choice="none", **args)
            events = list(client.responses.create(tool_choice="none", stream=True, **args))
        assert _items(out.output) == _items(events[-1].response.output) == [("message", script)]
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == script


def test_auto_tool_choice_without_a_parser_is_a_one_line_400_naming_the_flag(llm):
    script, _ = CALLS_AFTER_TEXT
    with _serving(llm, None, script) as (client, args):
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as info:
                client.responses.create(stream=stream, **args)
            error = info.value.body
            assert "--tool-call-parser (hermes, llama3_json, mistral)" in error["message"]
            assert "'required'" in error["message"] and "\n" not in error["message"]
            assert error["param"] == "tool_choice"


def test_a_call_cut_by_max_output_tokens_is_an_incomplete_item_with_the_arguments_so_far(llm):
    script = _hermes(WEATHER)[:-30]  # the model's last token inside the arguments
    with _serving(llm, "hermes", script, finish_reason="length") as (client, args):
        out = client.responses.create(**args)
    assert out.status == "incomplete" and [item.type for item in out.output] == ["function_call"]
    call = out.output[0]
    assert call.status == "incomplete" and call.name == "get_weather"
    assert json.dumps(WEATHER[1]).startswith(call.arguments) and call.arguments != json.dumps(WEATHER[1])
