"""What the engine returns beyond tokens, on the lane's device: prompt logprobs against HF transformers (float32,
chunked prefill), and structured output through the device's `apply_token_bitmask` and sampler, with overlap
scheduling on and off (a grammar's mask needs the previous token: overlap must wait for it)."""

from __future__ import annotations

import json
import re

import pytest
import torch

from omnirun.engine import LLM, Engine
from omnirun.sampling import SamplingParams
from omnirun.testing import make_runner

SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "age": {"type": "integer", "minimum": 0, "maximum": 99},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        },
        "required": ["name", "age", "tags"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "ok": {"type": "boolean"},
            "inner": {
                "type": "object",
                "properties": {"x": {"type": "number", "minimum": -5, "maximum": 5}, "y": {"enum": ["p", "q r"]}},
                "required": ["x", "y"],
                "additionalProperties": False,
            },
        },
        "required": ["ok", "inner"],
        "additionalProperties": False,
    },
]


@pytest.mark.parametrize("chunk", [None, 16], ids=["one_prefill", "chunks_of_16"])
def test_prompt_logprobs_equal_hf_log_softmax(platform, tiny_checkpoints, chunk):
    checkpoint = tiny_checkpoints["llama"]
    prompt = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    with LLM(str(checkpoint.plain), device=platform, dtype="float32", max_total_tokens=4096, progress=False,
             chunked_prefill_size=chunk) as llm:  # fmt: skip
        params = SamplingParams(max_new_tokens=0, prompt_logprobs=2)
        (output,) = llm.generate([prompt], params, use_tqdm=False)
    with torch.no_grad():
        logits = checkpoint.hf_model(torch.tensor([prompt], device=platform.device())).logits[0].float().cpu()
    expected = torch.log_softmax(logits, dim=-1)[:-1]
    chosen = expected.gather(-1, torch.tensor(prompt[1:]).unsqueeze(-1)).squeeze(-1)
    assert output.prompt_logprobs[0] is None and output.token_ids == []
    torch.testing.assert_close(torch.tensor(output.prompt_logprobs[1:]), chosen, atol=1e-4, rtol=0)
    assert [[t for t, _ in step] for step in output.prompt_top_logprobs[1:]] == expected.topk(2).indices.tolist()


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_structured_output_matches_its_constraints(platform, overlap):
    pytest.importorskip("xgrammar", reason="structured output needs xgrammar (pip install 'omnirun[structured]')")
    jsonschema = pytest.importorskip("jsonschema", reason="the outputs are validated with jsonschema")
    from omnirun.engine.tokenizer import load_tokenizer
    from omnirun.structured import GrammarSpec

    runner = make_runner(platform, _default_model(), dtype="auto")  # (graphs where the device captures them)
    tokenizer = load_tokenizer(_default_model())
    engine = Engine(runner, tokenizer=tokenizer, eos_token_ids=[tokenizer.eos_token_id], overlap_schedule=overlap)
    try:
        specs = [GrammarSpec.json_schema(s) for s in SCHEMAS] + [GrammarSpec.regex("[0-9]{2}-[a-z]{3}")]
        requests = [
            engine.add_request(tokenizer.encode(f"prompt {i}"), params, detokenize=True)
            for i, params in enumerate(
                [
                    SamplingParams(max_new_tokens=300, temperature=t, seed=i, structured_output=spec)
                    for i, spec in enumerate(specs)
                    for t in (0.0, 1.0)
                ]  # fmt: skip
                + [SamplingParams(max_new_tokens=20, temperature=0)]  # a free request in the same batches
            )
        ]
        while engine.has_work:
            engine.step()
        texts = [engine.text_of(r) for r in requests]
        for i, schema in enumerate(SCHEMAS):
            for text in texts[2 * i : 2 * i + 2]:
                jsonschema.validate(json.loads(text), schema)
        assert all(re.fullmatch("[0-9]{2}-[a-z]{3}", t) for t in texts[-3:-1])
        assert all(r.finish_reason.value == "stop" for r in requests[:-1])
        assert len(requests[-1].output_ids) == 20
    finally:
        runner.close()


def _default_model() -> str:
    from omnirun.assets.default_model import default_model_dir

    return str(default_model_dir())
