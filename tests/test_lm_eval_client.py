"""lm-evaluation-harness as a real client of `omnirun serve`: two small tasks written here (a multiple-choice
log-likelihood task and a greedy generation task, from local JSON lines, offline) run through lm-eval's
`local-completions` model against the server, and through its `hf` model (transformers) on the same checkpoint; each
request's log-likelihood, each generated text and both metrics must agree.

The log-likelihood requests are what /v1/completions answers with `echo` and `logprobs` (lm-eval sends
`max_tokens: 1` and drops the new token's logprob): the prompt's logprobs (tests/test_server_prompt_logprobs.py checks
those through the openai client; this test checks them through lm-eval's own parsing)."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from omnirun.assets.default_model import default_model_dir
from omnirun.distributed.world import free_port
from omnirun.server.testing import wait_until_healthy

pytest.importorskip("lm_eval", reason="lm-evaluation-harness is not installed: pip install 'lm-eval[hf,api]'")
for _extra in ("accelerate", "tenacity", "aiohttp"):  # what lm-eval's hf and local-completions models import
    pytest.importorskip(_extra, reason="lm-eval's hf and api extras are not installed: pip install 'lm-eval[hf,api]'")
yaml = pytest.importorskip("yaml", reason="PyYAML (an lm-eval dependency) writes the task files")

MODEL = "omnirun-tiny"  # the served name, which lm-eval's requests name
MC_TASK, GEN_TASK = "omnirun_mc", "omnirun_gen"
# (question, choices, answer): some choices span several tokens, and some are the random model's greedy continuation
# (lm-eval's is_greedy then reads the server's top logprobs).
QUESTIONS = [
    ("The server sends each request to the", ["engine", "the the", "kernel", "cache"], 0),
    ("A kernel runs on the", ["device", "GPU", "into into", "host"], 0),
    ("Each page of the cache holds", ["tokens", "keys and values", "requests", "dsds"], 1),
    ("The tokenizer splits text into", ["tokens", "pages", "w w", "kernels"], 0),
    ("Q: What does the engine decode?\nA:", ["tokens", "text", "::", "pages"], 0),
    ("The prompt is", ["and and", "read first", "a list of token ids", "cached"], 2),
    ("Memory on the device holds the", ["weights", "KV cache", "prompt", "server"], 1),
    ("Count to three: one, two,", ["three", "four", "five", "six"], 0),
]
# Greedy continuations of these (8 tokens at most, cut at a newline) include partial UTF-8 bytes, control characters
# and, for the prompt that ends in a newline, nothing at all (the stop string comes first).
PROMPTS = [
    "Q: What does the engine decode?\nA:",
    "The server sends each request to the",
    "Memory is",
    "Count to three: one, two,",
    "kernel \n",
    "Each page of the cache holds",
]
MAX_GEN_TOKS = 8


def _env() -> dict[str, str]:
    # Nothing may come from the Hub: the model, tokenizer and data sets are all local.
    return {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def _greedy_texts(model_dir: str) -> list[str]:
    """transformers' own greedy continuation of each of PROMPTS, cut at the first newline."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    texts = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            out = model.generate(ids, max_new_tokens=MAX_GEN_TOKS, do_sample=False, pad_token_id=0)
            texts.append(tokenizer.decode(out[0, ids.shape[1] :]).split("\n")[0])
    return texts


def _write_tasks(root: Path, model_dir: str) -> int:
    """Both tasks' data (JSON lines) and lm-eval task YAMLs under `root`; returns how many generation targets are the
    model's own greedy text (the others are not), so that exact_match is neither 0 nor 1."""
    mc = [{"question": q, "choices": c, "answer": a} for q, c, a in QUESTIONS]
    (root / "mc.jsonl").write_text("".join(json.dumps(doc) + "\n" for doc in mc))
    greedy = _greedy_texts(model_dir)
    targets = [text if i % 2 == 0 else text + " (not this)" for i, text in enumerate(greedy)]
    gen = [{"prompt": p, "answer": t} for p, t in zip(PROMPTS, targets, strict=True)]
    (root / "gen.jsonl").write_text("".join(json.dumps(doc) + "\n" for doc in gen))
    common = {"dataset_path": "json", "test_split": "test", "metadata": {"version": 1.0}}
    mc_task = {
        "task": MC_TASK,
        **common,
        "dataset_kwargs": {"data_files": {"test": str(root / "mc.jsonl")}},
        "output_type": "multiple_choice",
        "doc_to_text": "{{question}}",
        "doc_to_choice": "{{choices}}",
        "doc_to_target": "answer",
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
    }
    gen_task = {
        "task": GEN_TASK,
        **common,
        "dataset_kwargs": {"data_files": {"test": str(root / "gen.jsonl")}},
        "output_type": "generate_until",
        "doc_to_text": "{{prompt}}",
        "doc_to_target": "{{answer}}",
        "generation_kwargs": {"until": ["\n"], "max_gen_toks": MAX_GEN_TOKS, "do_sample": False},
        "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
    }
    (root / "omnirun_mc.yaml").write_text(yaml.safe_dump(mc_task))
    (root / "omnirun_gen.yaml").write_text(yaml.safe_dump(gen_task))
    return sum(g == t for g, t in zip(greedy, targets, strict=True))


def _lm_eval(tasks: Path, out: Path, *args: str) -> tuple[dict, dict[str, list[dict]]]:
    """Run lm-eval's command line on both tasks; its results and each task's logged samples (by doc_id)."""
    argv = [sys.executable, "-m", "lm_eval", *args, "--tasks", f"{MC_TASK},{GEN_TASK}"]
    argv += ["--include_path", str(tasks), "--output_path", str(out), "--log_samples", "--verbosity", "WARNING"]
    done = subprocess.run(argv, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"lm-eval failed ({done.returncode}):\n{done.stderr[-6000:]}"
    (results,) = glob.glob(f"{out}/**/results_*.json", recursive=True)
    samples = {}
    for task in (MC_TASK, GEN_TASK):
        (path,) = glob.glob(f"{out}/**/samples_{task}_*.jsonl", recursive=True)
        docs = [json.loads(line) for line in Path(path).read_text().splitlines()]
        samples[task] = sorted(docs, key=lambda d: d["doc_id"])
    return json.loads(Path(results).read_text())["results"], samples


def _loglikelihoods(samples: dict[str, list[dict]]) -> list[tuple[float, bool]]:
    """Each multiple-choice request's (log-likelihood, is_greedy), in doc then choice order."""
    out = [(float(ll), str(greedy)) for doc in samples[MC_TASK] for ll, greedy in doc["filtered_resps"]]
    assert {greedy for _, greedy in out} <= {"True", "False"}
    return [(ll, greedy == "True") for ll, greedy in out]


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> tuple[Path, int]:
    root = tmp_path_factory.mktemp("lm_eval_tasks")
    return root, _write_tasks(root, default_model_dir())


@pytest.fixture(scope="module")
def hf_run(tasks, tmp_path_factory):
    """The reference: lm-eval's hf model (transformers, float32, CPU) on the same checkpoint."""
    out = tmp_path_factory.mktemp("lm_eval_hf")
    return _lm_eval(tasks[0], out, "--model", "hf", "--model_args", f"pretrained={default_model_dir()},dtype=float32")


def test_lm_eval_through_the_server_matches_lm_eval_on_transformers(tasks, hf_run, tmp_path):
    """omnirun serve as it starts by default: the engine in a process of its own (prompt logprobs cross the pipe)."""
    model_dir = default_model_dir()
    port = free_port()  # (a small race with other processes for this port; the test fails loudly if it loses it)
    argv = [sys.executable, "-m", "omnirun.cli", "serve", "--model", model_dir, "--device", "cpu", "--dtype", "float32"]
    argv += ["--port", str(port), "--served-model-name", MODEL, "--max-total-tokens", "8192", "--log-level", "warning"]
    log = tmp_path / "serve.log"
    with log.open("w") as log_file:
        server = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT, env=_env())
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until_healthy(url, server)
        model_args = f"model={MODEL},base_url={url}/v1/completions,tokenizer={model_dir},tokenizer_backend=huggingface"
        model_args += ",num_concurrent=1,max_retries=1"
        try:
            served, served_samples = _lm_eval(
                tasks[0], tmp_path / "out", "--model", "local-completions", "--model_args", model_args
            )
        except AssertionError as exc:
            raise AssertionError(f"{exc}\nserver log:\n{log.read_text()[-4000:]}") from None
    finally:
        server.terminate()
        server.wait(60)
    reference, reference_samples = hf_run

    # Log-likelihoods: per request (question x choice), lm-eval's (logprob sum, is_greedy), logged as strings.
    got, want = _loglikelihoods(served_samples), _loglikelihoods(reference_samples)
    assert len(got) == len(want) == sum(len(c) for _, c, _ in QUESTIONS)
    assert [ll for ll, _ in got] == pytest.approx([ll for ll, _ in want], abs=1e-4)
    assert [greedy for _, greedy in got] == [greedy for _, greedy in want]
    assert any(greedy for _, greedy in want), "no choice is greedy: is_greedy goes untested"
    assert served[MC_TASK]["acc,none"] == reference[MC_TASK]["acc,none"]

    # Generation: greedy, so the same text; exact_match counts the targets that are the model's own text.
    texts = [doc["filtered_resps"] for doc in served_samples[GEN_TASK]]
    assert texts == [doc["filtered_resps"] for doc in reference_samples[GEN_TASK]]
    _, matching = tasks
    assert served[GEN_TASK]["exact_match,none"] == reference[GEN_TASK]["exact_match,none"] == matching / len(PROMPTS)
