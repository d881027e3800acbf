"""tool_choice `auto` under the grammar (omnirun.server.tool_parsers.tagged): the structural tag lets free text
through and holds each call to its tool's schema once the model opens one; the reader sends a call's name as soon
as its header is complete and its arguments in pieces, and a stream cut anywhere puts together the finished
message's parse."""

from __future__ import annotations

import json
import random

import pytest

from omnirun.server.tool_parsers.hermes import HermesParser
from omnirun.server.tool_parsers.tagged import TaggedCalls

xgrammar = pytest.importorskip("xgrammar", reason="xgrammar is not installed (pip install 'omnirun[structured]')")

FUNCTIONS = {
    "get_weather": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    "get_time": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]},
}
WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris {}"}}\n</tool_call>'
TIME = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
TEXTS = {  # text -> (content, [(name, arguments as written)])
    f"Checking.\n{WEATHER}\n{TIME}": (
        "Checking.\n",
        [("get_weather", '{"city": "Paris {}"}'), ("get_time", '{"zone": "CET"}')],
    ),
    "No call at all.": ("No call at all.", []),
    WEATHER[: WEATHER.index("ris")]: (
        None,
        [("get_weather", '{"city": "Pa')],
    ),  # cut by max_tokens inside the arguments
    "see <tool_call>\nnot json": ("see <tool_call>\nnot json", []),  # only without the grammar: stays text
}


def _tagged() -> TaggedCalls:
    return TaggedCalls(HermesParser(), FUNCTIONS)


@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_the_parse_and_a_stream_cut_anywhere_agree(text):
    content, calls = TEXTS[text]
    got_content, got_calls = _tagged().parse(text)
    assert got_content == content and [(c.name, c.arguments) for c in got_calls] == calls
    for seed in range(20):
        rng, stream, at = random.Random(seed), _tagged().stream(), 0
        streamed, assembled = "", []
        while at < len(text):
            step = rng.randint(1, 8)
            delta = stream.feed(text[at : at + step], last=at + step >= len(text))
            at += step
            streamed += delta.content
            for piece in delta.tool_calls:
                if piece.name is not None:
                    assert piece.index == len(assembled) and piece.id.startswith("call_")
                    assembled.append([piece.name, ""])
                assembled[piece.index][1] += piece.arguments
        assert (streamed or None) == content if calls else streamed == content
        assert [tuple(c) for c in assembled] == calls


def test_arguments_are_sent_before_the_call_ends():
    stream = _tagged().stream()
    head = stream.feed('<tool_call>\n{"name": "get_weather", "arguments": ')
    assert [(d.name, d.arguments) for d in head.tool_calls] == [("get_weather", "")]
    assert stream.feed('{"city": "Pa').tool_calls[0].arguments == '{"city": "Pa'
    assert stream.feed('ris"}').tool_calls[0].arguments == 'ris"}'
    assert not stream.feed("}\n</tool_call>", last=True)


def test_the_grammar_lets_text_through_and_holds_calls_to_their_schema():
    grammar = xgrammar.Grammar.from_structural_tag(_tagged().spec.value)
    accepts = xgrammar.testing._is_grammar_accept_string
    assert accepts(grammar, f"Checking.\n{WEATHER}\n{TIME}") and accepts(grammar, "No call at all.")
    assert not accepts(grammar, '<tool_call>\n{"name": "get_wether", "arguments": {"city": "Paris"}}\n</tool_call>')
    assert not accepts(grammar, '<tool_call>\n{"name": "get_weather", "arguments": {"zone": "CET"}}\n</tool_call>')
    one = xgrammar.Grammar.from_structural_tag(TaggedCalls(HermesParser(), FUNCTIONS, parallel=False).spec.value)
    assert accepts(one, WEATHER) and not accepts(one, f"{WEATHER}\n{TIME}")
    assert json.loads(_tagged().spec.value)["format"]["triggers"] == ["<tool_call>"]
