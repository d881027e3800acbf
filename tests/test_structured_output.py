"""Structured output (SamplingParams.structured_output) with the embedded model, whose random weights would never
write JSON by themselves: every output of 100 random JSON schemas parses and validates with jsonschema; regex,
choice and EBNF constraints match; constrained and free requests share batches; overlap scheduling runs ahead of
grammars with the serial tokens; bad constraints are refused in one line."""

from __future__ import annotations

import itertools
import json
import random
import re

import pytest

pytest.importorskip("xgrammar", reason="structured output needs xgrammar (pip install 'omnirun[structured]')")
jsonschema = pytest.importorskip("jsonschema", reason="the outputs are validated with jsonschema")

from omnirun.engine import LLM  # noqa: E402
from omnirun.errors import OmnirunError  # noqa: E402
from omnirun.sampling import SamplingParams  # noqa: E402
from omnirun.structured import GrammarSpec, StructuredOutputError  # noqa: E402

FLAGS = {"device": "cpu", "dtype": "float32", "max_total_tokens": 65536, "progress": False}


@pytest.fixture(scope="module")
def llm():
    with LLM(**FLAGS) as llm:
        yield llm


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """An object of 1-4 fields: strings (bounded), integers and numbers with bounds, booleans, enums, arrays,
    nested objects; some required. Everything bounded, so that a complete value always fits the token budget."""
    kinds = ["string", "integer", "number", "boolean", "enum", "array"] + (["object"] if depth < 2 else [])
    properties = {}
    for i in range(rng.randint(1, 4)):
        kind = rng.choice(kinds)
        if kind == "string":
            prop = {"type": "string", "maxLength": rng.randint(1, 6)}
        elif kind == "integer":
            low = rng.randint(-50, 50)
            prop = {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 100)}
        elif kind == "number":
            prop = {"type": "number", "minimum": -10, "maximum": 10}
        elif kind == "boolean":
            prop = {"type": "boolean"}
        elif kind == "enum":
            prop = {"enum": rng.sample(["red", "green", "blue", "x y", 'q"uote'], rng.randint(1, 3))}
        elif kind == "array":
            prop = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3}
        else:
            prop = random_schema(rng, depth + 1)
        properties[f"f{i}_{kind}"] = prop
    required = [name for name in properties if rng.random() < 0.6]
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


def test_100_random_json_schemas_give_outputs_that_parse_and_validate(llm):
    rng = random.Random(0)
    schemas = [random_schema(rng) for _ in range(100)]
    params = [
        SamplingParams(
            max_new_tokens=400,
            temperature=0 if i % 2 else 1.0,
            seed=i,
            structured_output=GrammarSpec.json_schema(schema),
        )
        for i, schema in enumerate(schemas)
    ]
    outputs = llm.generate(["Write JSON."] * len(schemas), params, use_tqdm=False)
    for schema, output in zip(schemas, outputs, strict=True):
        assert output.finish_reason == "stop", (schema, output.text)
        jsonschema.validate(json.loads(output.text), schema)


def test_json_object_regex_choice_and_ebnf(llm):
    specs = {
        "json_object": GrammarSpec.json_object(),
        "regex": GrammarSpec.regex(r"[0-9]{3}-[a-z]{2,4}"),
        "choice": GrammarSpec.choice(["yes", "no way", 'say "hi"']),
        "ebnf": GrammarSpec.ebnf('root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'),
    }
    # Any JSON object has unbounded strings: a bias towards closing them lets the random model finish one.
    closing = {llm.tokenizer.convert_tokens_to_ids(t): 6.0 for t in ('"', "}")}
    params = [
        SamplingParams(max_new_tokens=100, temperature=1.0, seed=3, structured_output=s, logit_bias=closing)
        for s in specs.values()
    ]
    outputs = dict(zip(specs, llm.generate(["Go."] * len(specs), params, use_tqdm=False), strict=True))
    assert isinstance(json.loads(outputs["json_object"].text), dict)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", outputs["regex"].text)
    assert outputs["choice"].text in ("yes", "no way", 'say "hi"')
    assert re.fullmatch(r"\((?:[1-9][0-9]?)(?:\+[1-9][0-9]?)*\)", outputs["ebnf"].text)
    assert all(o.finish_reason == "stop" for o in outputs.values())


def test_constrained_and_free_requests_share_a_batch(llm):
    free = SamplingParams(max_new_tokens=12, temperature=0)
    alone = llm.generate(["Once upon a time"], free, use_tqdm=False)[0].token_ids
    constrained = SamplingParams(max_new_tokens=50, temperature=0, structured_output=GrammarSpec.regex("[a-c]{5}"))
    together = llm.generate(["Once upon a time", "Pick letters"], [free, constrained], use_tqdm=False)
    assert together[0].token_ids == alone
    assert re.fullmatch("[a-c]{5}", together[1].text)


def _constrained_run(llm: LLM, overlap: bool, calls: list[str] | None = None) -> list[list[int]]:
    """Three seeded JSON-schema requests and a free one through an engine of its own over `llm`'s runner; the
    tokens of each. `calls` (if given) records forward passes and step completions in order, with the step's batch."""
    from omnirun.engine.engine import Engine

    engine = Engine(
        llm.runner, tokenizer=llm.tokenizer, eos_token_ids=llm.engine.eos_token_ids, overlap_schedule=overlap
    )
    if calls is not None:
        forward, complete = llm.runner.forward, engine._complete
        llm.runner.forward = lambda batch: calls.append(("forward", batch)) or forward(batch)
        engine._complete = lambda launched: (
            (launched and calls.append(("complete", launched.step.batch))) or complete(launched)
        )
    schema = random_schema(random.Random(7))
    requests = [
        engine.add_request(
            llm.tokenizer.encode(prompt),
            SamplingParams(
                max_new_tokens=300, temperature=1.0, seed=i, structured_output=GrammarSpec.json_schema(schema)
            ),
            detokenize=True,
        )
        for i, prompt in enumerate(["a", "bb", "ccc"])
    ] + [engine.add_request(llm.tokenizer.encode("free"), SamplingParams(max_new_tokens=40, temperature=0))]
    try:
        while engine.has_work:
            engine.step()
    finally:
        if calls is not None:
            del llm.runner.forward
    for req in requests[:3]:
        assert req.finish_reason.value == "stop"
        jsonschema.validate(json.loads(engine.text_of(req)), schema)
    assert len(requests[3].output_ids) == 40
    return [list(req.output_ids) for req in requests]


def test_overlap_scheduling_runs_ahead_of_grammars_and_gives_the_serial_tokens():
    """With overlap on (the default on GPUs), a grammar's mask needs the token sampled one step before: the engine
    queues the next forward pass, completes the step in flight while it runs, then fills the masks and samples. The
    tokens are those of serial scheduling (seeded sampling), and forward passes do run ahead of completions. With a
    mask filled before the step in flight completes, the grammar would be a token behind and the outputs would
    neither validate nor match."""
    llm = LLM(**FLAGS)  # engines of their own over this runner (each takes over the KV pool)
    try:
        serial = _constrained_run(llm, overlap=False)
        calls: list[tuple[str, object]] = []
        assert _constrained_run(llm, overlap=True, calls=calls) == serial
        # A forward pass followed by the completion of another (earlier) step: it ran ahead.
        ahead = sum(
            1
            for (first, batch), (then, other) in itertools.pairwise(calls)
            if (first, then) == ("forward", "complete") and other is not batch
        )
        assert ahead > 20, f"forward passes ran ahead of the step in flight {ahead} times of {len(calls) // 2}"
    finally:
        llm.close()


@pytest.mark.parametrize(
    "spec, message",
    [
        (GrammarSpec.json_schema({"type": "object", "properties": {"a": {"type": "nonsense"}}}), "json schema"),
        (GrammarSpec.regex("[a-"), "regex"),
        (GrammarSpec.ebnf("root ::= missing_rule"), "ebnf"),
    ],
)
def test_a_constraint_that_does_not_compile_is_refused_in_one_line(llm, spec, message):
    with pytest.raises(
        StructuredOutputError, match=f"^cannot compile the {message} constraint: .*; fix it or drop it$"
    ):
        llm.generate(["x"], SamplingParams(structured_output=spec), use_tqdm=False)


def test_bad_specs_are_refused_before_anything_compiles():
    with pytest.raises(OmnirunError, match="kind 'yaml' is unknown"):
        GrammarSpec("yaml", "")
    with pytest.raises(OmnirunError, match="not JSON"):
        GrammarSpec.json_schema("{nope")
    with pytest.raises(OmnirunError, match="structured_output"):
        SamplingParams(structured_output={"type": "object"})
