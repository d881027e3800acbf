"""The embedded default model: complete, loadable by HF transformers and by omnirun, and reproducible by its script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from omnirun.assets.default_model import DEFAULT_MODEL_DIR, default_model_dir

SCRIPT = Path(__file__).resolve().parents[1] / "tools" / "make_default_model.py"
TEXTS = [
    "Hello",
    "Hello, world! The KV cache is paged: 16 tokens a page.",
    "  leading spaces, tabs\tand\nnewlines; odd ~`^|{} chars @#$%",
    "",
]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(default_model_dir())


@pytest.fixture(scope="module")
def hf_model():
    return AutoModelForCausalLM.from_pretrained(default_model_dir(), dtype=torch.float32).eval()


def test_directory_holds_config_weights_and_tokenizer():
    assert default_model_dir() == str(DEFAULT_MODEL_DIR)
    names = {p.name for p in DEFAULT_MODEL_DIR.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "README.md"} <= names
    assert sum(p.stat().st_size for p in DEFAULT_MODEL_DIR.iterdir()) < 1_500_000


def test_tokenizer_round_trips_text(tokenizer):
    assert len(tokenizer) == 512
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.unk_token) == ("<s>", "</s>", "<unk>")
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert tokenizer.unk_token_id not in ids
        assert tokenizer.decode(ids) == text
    # BPE merges learnt from the corpus: common words take fewer tokens than bytes.
    assert len(tokenizer.encode("the model runner")) < len("the model runner")


def test_config_is_a_llama_sized_for_the_tokenizer(tokenizer):
    config = AutoConfig.from_pretrained(default_model_dir())
    assert config.model_type == "llama"
    assert config.architectures == ["LlamaForCausalLM"]
    assert config.vocab_size == len(tokenizer)
    assert config.bos_token_id == tokenizer.bos_token_id
    assert config.eos_token_id == tokenizer.eos_token_id
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (128, 4, 4)
    assert config.num_key_value_heads == 2 and config.tie_word_embeddings


def test_hf_loads_the_weights_and_generates(hf_model, tokenizer):
    # Every weight comes from the checkpoint: none was missing and left to a fresh random init.
    stored = load_file(DEFAULT_MODEL_DIR / "model.safetensors")
    params = dict(hf_model.named_parameters())
    for name, tensor in stored.items():
        assert torch.equal(params[name].detach(), tensor.float()), name
    assert set(params) - set(stored) <= {"lm_head.weight"}  # tied to the embedding
    assert hf_model.lm_head.weight.data_ptr() == hf_model.model.embed_tokens.weight.data_ptr()

    ids = tokenizer("Hello", return_tensors="pt")
    out = hf_model.generate(
        **ids, max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=tokenizer.eos_token_id
    )
    assert out.shape == (1, ids["input_ids"].shape[1] + 5)
    assert isinstance(tokenizer.decode(out[0]), str)


def test_omnirun_runner_matches_hf_on_the_default_model(hf_model, tokenizer):
    from omnirun.registry import get_platform
    from omnirun.testing import greedy_gap, greedy_generate, make_runner

    prompt = tokenizer.encode("Hello, world!")
    runner = make_runner(get_platform("cpu"), default_model_dir())
    tokens = greedy_generate(runner, [prompt], 8)[0]
    gap, _ = greedy_gap(hf_model, prompt, tokens)
    assert gap < 1e-4, f"omnirun's greedy tokens {tokens} differ from HF's (logit gap {gap})"


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


def test_script_reproduces_the_shipped_files(tmp_path):
    """What the script decides must come out the same; what a library writes of its own (its version string, the
    layout of its files) may change with a release without failing us."""
    out = tmp_path / "model"
    # Another hash seed than the shipping run, so dict/set ordering cannot hide behind luck.
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], check=True, capture_output=True, env=env)
    made, shipped = out, DEFAULT_MODEL_DIR

    assert (made / "chat_template.jinja").read_bytes() == (shipped / "chat_template.jinja").read_bytes()
    config, shipped_config = _json(made / "config.json"), _json(shipped / "config.json")
    for entry in (config, shipped_config):
        entry.pop("transformers_version", None)
    assert config == shipped_config

    ours, theirs = load_file(made / "model.safetensors"), load_file(shipped / "model.safetensors")
    assert sorted(ours) == sorted(theirs)
    for name, tensor in ours.items():
        assert tensor.dtype == theirs[name].dtype and torch.equal(tensor, theirs[name]), name

    tokenizer, shipped_tokenizer = _json(made / "tokenizer.json"), _json(shipped / "tokenizer.json")
    for key in ("vocab", "merges", "type", "unk_token"):
        assert tokenizer["model"][key] == shipped_tokenizer["model"][key], key
    specials = [(t["id"], t["content"], t["special"]) for t in tokenizer["added_tokens"]]
    assert specials == [(t["id"], t["content"], t["special"]) for t in shipped_tokenizer["added_tokens"]]
    made_tok, shipped_tok = AutoTokenizer.from_pretrained(made), AutoTokenizer.from_pretrained(shipped)
    for text in TEXTS:
        assert made_tok.encode(text) == shipped_tok.encode(text), text
    # The keys the script passes to the tokenizer (the rest is the library's to write).
    chosen = ("bos_token", "eos_token", "unk_token", "model_max_length", "clean_up_tokenization_spaces")
    made_cfg, shipped_cfg = _json(made / "tokenizer_config.json"), _json(shipped / "tokenizer_config.json")
    assert {k: made_cfg.get(k) for k in chosen} == {k: shipped_cfg.get(k) for k in chosen}


def test_chat_template_renders_turns_and_the_generation_prompt(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<s>system\nBe brief.</s>\n<s>user\nHello</s>\n<s>assistant\n"
