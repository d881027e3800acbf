"""The tool call parsers on fixed model texts: each format's documented examples, several calls, content around
them, JSON that is not a call staying content, a call whose header was read standing whatever follows; and
streamed, the text cut into random pieces gives deltas that assemble into the finished message's parse, a call's
arguments (llama3_json, mistral) in pieces as they come."""

from __future__ import annotations

import json
import random
import re

import pytest

from omnirun.errors import ConfigError
from omnirun.server.tool_parsers import TOOL_PARSERS, ToolCall, get_tool_parser
from omnirun.server.tool_parsers.base import CallDone, finished


def call(name: str, **arguments) -> ToolCall:
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


WEATHER = call("get_current_temperature", location="San Francisco, CA, USA")
TIME = call("get_time", zone="CET")
# Nested objects, and strings holding braces, brackets, quotes, backslashes, a tag's text and non-ASCII: an
# escaped quote before a brace, a string ending in a backslash before one.
NESTED = call(
    "write_file",
    path="C:\\tmp\\",
    data={"rows": [1, {"x": "}{]["}], "empty": {}},
    note='a "quote } [TOOL_CALLS] <tool_call> é',
    after="{",
)


def written(name: str, arguments: str) -> ToolCall:
    """A call whose arguments are the model's text, whatever it is (a begun call keeps what was streamed)."""
    return ToolCall(name, arguments)


def _json(c: ToolCall, key: str = "arguments") -> str:
    return json.dumps({"name": c.name, key: json.loads(c.arguments)}, ensure_ascii=False)


def _block(c: ToolCall) -> str:
    return f"<tool_call>\n{_json(c)}\n</tool_call>"


# (text, content, calls): content None when calls took the whole message.
HERMES = {
    # Qwen2.5's documented example (its chat template's instructions and Qwen's function-calling docs)
    "documented": (_block(WEATHER), None, [WEATHER]),
    "several calls": (_block(WEATHER) + "\n" + _block(TIME) + "\n", None, [WEATHER, TIME]),
    "text before": ("Let me check.\n" + _block(WEATHER), "Let me check.\n", [WEATHER]),
    "text between and after": (
        _block(WEATHER) + "\nthen\n" + _block(TIME) + " done",
        "\nthen\n done",
        [WEATHER, TIME],
    ),
    "nested and escaped": (_block(NESTED), None, [NESTED]),
    "no closing tag at the end": ("<tool_call>\n" + _json(TIME), None, [TIME]),
    "no calls": (
        "The weather is fine. 1 < 2 and <tool is no tag.",
        "The weather is fine. 1 < 2 and <tool is no tag.",
        [],
    ),
    "invalid json": (
        '<tool_call>\n{"name": "f", "arguments": {"a": }}\n</tool_call>',
        '<tool_call>\n{"name": "f", "arguments": {"a": }}\n</tool_call>',
        [],
    ),
    "invalid among valid": (
        _block(WEATHER) + "\n<tool_call>\n{'name': 'f'}\n</tool_call>",
        "\n<tool_call>\n{'name': 'f'}\n</tool_call>",
        [WEATHER],
    ),
    "no name": ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    "arguments not an object": (
        '<tool_call>{"name": "f", "arguments": "x"}</tool_call>',
        '<tool_call>{"name": "f", "arguments": "x"}</tool_call>',
        [],
    ),
    "NaN is no JSON": (
        '<tool_call>{"name": "f", "arguments": {"a": NaN}}</tool_call>',
        '<tool_call>{"name": "f", "arguments": {"a": NaN}}</tool_call>',
        [],
    ),
    "cut inside a call": ('Hi <tool_call>\n{"name": "f", "argu', 'Hi <tool_call>\n{"name": "f", "argu', []),
}

LLAMA3_JSON = {
    # Meta's Llama 3.1 JSON tool calling example ({"name": function name, "parameters": {...}})
    "documented": (_json(WEATHER, "parameters"), None, [WEATHER]),
    "python tag": ("<|python_tag|>" + _json(WEATHER, "parameters"), None, [WEATHER]),
    "several calls": (
        _json(WEATHER, "parameters") + "; " + _json(TIME, "parameters") + ";" + _json(NESTED, "parameters"),
        None,
        [WEATHER, TIME, NESTED],
    ),
    "arguments for parameters": ("\n " + _json(TIME, "arguments") + "\n", None, [TIME]),
    "no calls": ("It is sunny in Paris.", "It is sunny in Paris.", []),
    "text before is no call": ("Sure: " + _json(TIME, "parameters"), "Sure: " + _json(TIME, "parameters"), []),
    "a json answer": ('{"answer": 42, "unit": "{°C}"}', '{"answer": 42, "unit": "{°C}"}', []),
    "invalid json before the arguments": ('{"name": f, "parameters": {}}', '{"name": f, "parameters": {}}', []),
    "keys in another order": ('{"parameters": {}, "name": "f"}', '{"parameters": {}, "name": "f"}', []),
    "arguments not an object": ('{"name": "f", "parameters": "x"}', '{"name": "f", "parameters": "x"}', []),
    # once the header is read the call stands (a stream has sent it): its arguments as written, the rest content
    "invalid json in the arguments": ('{"name": "f", "parameters": {\'a\': 1}}', None, [written("f", "{'a': 1}")]),
    "a key after the arguments": (
        '{"name": "f", "parameters": {}, "arguments": {}}',
        ', "arguments": {}}',
        [written("f", "{}")],
    ),
    "cut inside the arguments": ('{"name": "f", "parameters": {"a": "}', None, [written("f", '{"a": "}')]),
    "cut before the object's end": (_json(TIME, "parameters")[:-1] + " ", None, [TIME]),
    "a call, then no call": (
        _json(TIME, "parameters") + '; {"name": 7}',
        '; {"name": 7}',
        [TIME],
    ),
    "a call, then text": (_json(TIME, "parameters") + "\nDone.", "\nDone.", [TIME]),
    "cut inside a call": ('<|python_tag|>{"name": "f", "param', '<|python_tag|>{"name": "f", "param', []),
}

MISTRAL = {
    # Mistral 7B Instruct v0.3's format (vLLM's mistral parser and tool_chat_template_mistral.jinja)
    "documented": ("[TOOL_CALLS] [" + _json(WEATHER) + "]", None, [WEATHER]),
    "several calls": ("[TOOL_CALLS][" + _json(WEATHER) + ", " + _json(NESTED) + "]", None, [WEATHER, NESTED]),
    "text before": ("Checking. [TOOL_CALLS] [" + _json(TIME) + "]\n", "Checking. ", [TIME]),
    "no calls": ("No tools needed [TOOL_ here.", "No tools needed [TOOL_ here.", []),
    "invalid json before a call": ('[TOOL_CALLS] [{"name": f}]', '[TOOL_CALLS] [{"name": f}]', []),
    "an empty list": ("[TOOL_CALLS] [] ok", "[TOOL_CALLS] [] ok", []),
    # once a header is read the call stands (a stream has sent it): its arguments as written, the rest content
    "no object end after the arguments": (
        '[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1},]',
        ",]",
        [written("f", '{"a": 1}')],
    ),
    "an item is no call": ("[TOOL_CALLS] [" + _json(TIME) + ', {"name": "g"}]', ', {"name": "g"}]', [TIME]),
    "cut inside the arguments": (
        '[TOOL_CALLS] [{"name": "f", "arguments": {"a": [1',
        None,
        [written("f", '{"a": [1')],
    ),
    "no list after the marker": ("[TOOL_CALLS] get_time{}", "[TOOL_CALLS] get_time{}", []),
    "cut inside the list": ('[TOOL_CALLS] [{"name": "f"', '[TOOL_CALLS] [{"name": "f"', []),
    # v11+ (mistral_common's InstructTokenizerV11 / V13): [TOOL_CALLS]name[CALL_ID]id[ARGS]{arguments} per call
    "v13 calls": (
        "[TOOL_CALLS]get_time[ARGS]" + TIME.arguments + "[TOOL_CALLS]write_file[ARGS]" + NESTED.arguments,
        None,
        [TIME, NESTED],
    ),
    "v11 call ids, text around": (
        "On it.[TOOL_CALLS]get_current_temperature[CALL_ID]a1B2c3D4e[ARGS]" + WEATHER.arguments + " Done.",
        "On it. Done.",
        [WEATHER],
    ),
    "v11 markers skipped": ("[TOOL_CALLS]get_time" + TIME.arguments, None, [TIME]),
    "v11 name no call": ("[TOOL_CALLS]get time[ARGS]{}", "[TOOL_CALLS]get time[ARGS]{}", []),
    "v11 arguments no object": ("[TOOL_CALLS]f[ARGS][1, 2]", "[TOOL_CALLS]f[ARGS][1, 2]", []),
    "v11 invalid json": ('[TOOL_CALLS]f[ARGS]{"a": 1,}', None, [written("f", '{"a": 1,}')]),
    "v11 cut inside the arguments": ('[TOOL_CALLS]f[ARGS]{"a": "}', None, [written("f", '{"a": "}')]),
}

CASES = {"hermes": HERMES, "llama3_json": LLAMA3_JSON, "mistral": MISTRAL}
ALL = [(parser, case) for parser, cases in CASES.items() for case in cases]


def test_every_registered_parser_is_tested_and_unknown_names_are_refused():
    assert set(CASES) == set(TOOL_PARSERS)
    with pytest.raises(ConfigError, match="hermes, llama3_json, mistral"):
        get_tool_parser("qwen")


@pytest.mark.parametrize("parser, case", ALL, ids=[f"{p}-{c}" for p, c in ALL])
def test_parse_finds_the_calls_and_leaves_the_rest_as_content(parser, case):
    text, content, calls = CASES[parser][case]
    assert get_tool_parser(parser).parse(text) == (content, calls)


def _pieces(text: str, rng: random.Random | None) -> list[str]:
    """`text` cut into pieces of 1 to 8 characters (each character alone without rng)."""
    pieces, at = [], 0
    while at < len(text):
        size = rng.randint(1, 8) if rng is not None else 1
        pieces.append(text[at : at + size])
        at += size
    return pieces


def _assemble(parser_name: str, pieces: list[str]) -> tuple[str, list[ToolCall]]:
    """Stream `pieces` and put the deltas together as an OpenAI client does, checking their shape on the way."""
    stream = get_tool_parser(parser_name).stream()
    content, names, ids, arguments = "", {}, {}, {}
    for i, piece in enumerate(pieces):
        delta = stream.feed(piece, last=i == len(pieces) - 1)
        content += delta.content
        for d in delta.tool_calls:
            if d.id is not None:  # the first piece of a call: its id and name, once
                assert d.index == len(ids) and d.index not in ids and d.name
                ids[d.index], names[d.index] = d.id, d.name
            else:
                assert d.name is None and d.index in ids
            arguments[d.index] = arguments.get(d.index, "") + d.arguments
    assert len(set(ids.values())) == len(ids) == stream.calls
    return content, [ToolCall(names[i], arguments[i]) for i in range(len(ids))]


@pytest.mark.parametrize("parser, case", ALL, ids=[f"{p}-{c}" for p, c in ALL])
@pytest.mark.parametrize("seed", [None, 0, 1, 2, 3, 4])
def test_streamed_pieces_assemble_into_the_parse(parser, case, seed):
    text = CASES[parser][case][0]
    content, calls = get_tool_parser(parser).parse(text)
    pieces = _pieces(text, random.Random(seed) if seed is not None else None)
    assert _assemble(parser, pieces) == (content or "", calls)


# Two calls per format whose arguments the stream sends in pieces, the first with NESTED's arguments.
STREAMED = {
    "llama3_json": "<|python_tag|>" + _json(NESTED, "parameters") + "; " + _json(TIME, "parameters"),
    "mistral": "[TOOL_CALLS] [" + _json(NESTED) + ", " + _json(TIME) + "]",
    "mistral v11": f"[TOOL_CALLS]write_file[CALL_ID]a1B2c3D4e[ARGS]{NESTED.arguments}[TOOL_CALLS]get_time{{}}",
}


@pytest.mark.parametrize("case", STREAMED)
@pytest.mark.parametrize("seed", [None, 0, 1, 2])
def test_a_calls_arguments_stream_in_pieces_as_they_come(case, seed):
    text, parser = STREAMED[case], case.split()[0]
    start = text.index(NESTED.arguments)
    closed = start + len(NESTED.arguments)  # where the first call's arguments end
    stream, fed, named_at, sent, deltas = get_tool_parser(parser).stream(), 0, None, "", 0
    for piece in _pieces(text, random.Random(seed) if seed is not None else None):
        delta = stream.feed(piece)
        fed += len(piece)
        for d in (d for d in delta.tool_calls if d.index == 0):
            named_at = fed if d.name is not None else named_at
            sent, deltas = sent + d.arguments, deltas + bool(d.arguments)
        if named_at is not None:  # all of the arguments the text holds so far is sent, nothing held back
            assert sent == text[start : min(fed, closed)]
    assert named_at is not None and named_at < closed  # the name went out before the arguments closed
    assert deltas > 1 and sent == NESTED.arguments
    assert stream.calls == 2


def _all_pieces(parser: str, text: str) -> list:
    stream, pieces = get_tool_parser(parser).stream(), []
    chunks = _pieces(text, random.Random(0))
    for i, chunk in enumerate(chunks):
        pieces += stream.pieces(chunk, last=i == len(chunks) - 1)
    return pieces


@pytest.mark.parametrize("case", STREAMED)
def test_a_message_cut_inside_the_arguments_ends_with_the_call_cut(case):
    """As OpenAI's: the call keeps the arguments sent, and is not done (the Responses API's item is incomplete)."""
    text, parser = STREAMED[case], case.split()[0]
    whole = _all_pieces(parser, text)
    assert [p for p in whole if isinstance(p, CallDone)] == [CallDone(0), CallDone(1)]
    cut = text.index(NESTED.arguments) + 20
    pieces = _all_pieces(parser, text[:cut])
    assert finished(pieces) == (None, [written(NESTED.name, NESTED.arguments[:20])])
    assert not [p for p in pieces if isinstance(p, CallDone)]


def test_a_begun_call_stands_when_its_object_goes_on_and_what_follows_is_content():
    stream = get_tool_parser("llama3_json").stream()
    head = stream.feed('{"name": "get_time", "parameters": {"zone": "C')
    assert [(d.index, d.name, d.arguments) for d in head.tool_calls] == [(0, "get_time", '{"zone": "C')]
    assert [d.arguments for d in stream.feed('ET"}').tool_calls] == ['ET"}']
    rest = stream.feed(', "strict": true}; {"name": "f", "parameters": {}}', last=True)
    assert rest.content == ', "strict": true}; {"name": "f", "parameters": {}}' and not rest.tool_calls
    assert stream.calls == 1

    stream = get_tool_parser("mistral").stream()
    head = stream.feed('[TOOL_CALLS] [{"name": "get_time", "arguments": {}')
    assert [(d.name, d.arguments) for d in head.tool_calls] == [("get_time", "{}")]
    rest = stream.feed(', "strict": true}]', last=True)
    assert rest.content == ', "strict": true}]' and not rest.tool_calls and stream.calls == 1


def test_a_stream_sends_content_at_once_and_holds_back_only_what_may_begin_a_call():
    stream = get_tool_parser("hermes").stream()
    assert stream.feed("Let me ").content == "Let me "
    assert stream.feed("check <tool").content == "check "  # "<tool" may begin <tool_call>
    delta = stream.feed('_call>\n{"name": "get_time", "arguments": {"zone": ')
    assert not delta  # a call is sent once its JSON is whole
    delta = stream.feed('"CET"}}\n</tool_call>')
    assert delta.content == "" and [(d.index, d.name, d.arguments) for d in delta.tool_calls] == [
        (0, "get_time", '{"zone": "CET"}')
    ]
    assert re.fullmatch(r"call_[0-9a-f]{24}", delta.tool_calls[0].id)
    assert stream.feed(" <b>bold</b>", last=True).content == " <b>bold</b>"

    stream = get_tool_parser("mistral").stream()
    assert stream.feed("Sure [TOOL").content == "Sure "
    delta = stream.feed("_CALLS] [" + _json(TIME) + "]", last=True)
    assert re.fullmatch(r"[A-Za-z0-9]{9}", delta.tool_calls[0].id)  # Mistral's templates refuse other ids


def test_a_message_of_calls_only_has_no_content_but_text_alone_keeps_its_whitespace():
    hermes = get_tool_parser("hermes")
    assert hermes.parse("\n" + _block(TIME) + "\n\n") == (None, [TIME])
    assert hermes.parse("  \n") == ("  \n", [])
    assert hermes.parse("") == ("", [])
