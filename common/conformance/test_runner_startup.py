"""Start-up of the runner on the lane's device: presets, dtypes, KV sizing, backend choice, and clear errors."""

from __future__ import annotations

import json

import pytest
import torch

from omnirun.batch import ForwardBatch, build_batch
from omnirun.errors import ConfigError, KVPoolTooSmallError, UnsupportedModelError
from omnirun.sampling import SamplingParams
from omnirun.testing import greedy_gap, greedy_generate, hf_greedy, make_runner, tiny_hf_model


def test_dummy_preset_runs_and_is_seeded(platform):
    a = make_runner(platform, "tiny-llama", load_format="dummy", seed=7)
    b = make_runner(platform, "tiny-llama", load_format="dummy", seed=7)
    prompt = [1, 5, 9, 2, 7]
    tokens = greedy_generate(a, [prompt], 8)
    assert tokens == greedy_generate(b, [prompt], 8)
    assert len(tokens[0]) == 8 and all(0 <= t < a.shape.vocab_size for t in tokens[0])
    c = make_runner(platform, "tiny-llama", load_format="dummy", seed=8)
    assert not torch.equal(a.get_weights_by_name("lm_head.weight"), c.get_weights_by_name("lm_head.weight"))


def test_bf16_greedy_matches_hf(platform, tmp_path):
    if torch.bfloat16 not in platform.capabilities.model_dtypes:
        pytest.skip(f"{platform.capabilities.device_name} does not compute in bf16")
    model = tiny_hf_model("llama", dtype=torch.bfloat16)
    model.save_pretrained(tmp_path)
    runner = make_runner(platform, tmp_path, dtype="auto")
    assert runner.dtype == torch.bfloat16  # auto takes the checkpoint's dtype
    prompt = list(range(10, 42))
    model = model.to(runner.device)
    tokens = greedy_generate(runner, [prompt], 32)[0]
    if tokens != hf_greedy(model, prompt, 32):
        # Different (equally valid) bf16 kernels may round a near-tie the other way; every token must still be
        # HF's own choice up to bf16 resolution when HF is fed our sequence.
        gap, scale = greedy_gap(model, prompt, tokens)
        assert gap <= 2**-6 * scale, f"token off HF's argmax by {gap} (logits up to {scale})"


def test_fp8_kv_cache_stays_close(platform, tiny_checkpoints):
    if not platform.capabilities.fp8:
        pytest.skip(f"{platform.capabilities.device_name} has no fp8")
    checkpoint = tiny_checkpoints["llama"]
    exact = make_runner(platform, checkpoint.plain)
    fp8 = make_runner(platform, checkpoint.plain, kv_cache_dtype="fp8_e4m3")
    assert fp8.kv.kv_cache.dtype == platform.capabilities.fp8_e4m3_dtype
    prompt = list(range(3, 40))
    logits = []
    for runner in (exact, fp8):
        row = runner.kv.new_request()
        batch = build_batch(runner.kv, [row], [0], [prompt], runner.device)
        logits.append(runner.forward(batch).float())
        runner.kv.release(row)
    # e4m3 keeps 3 mantissa bits: the logits move, but only a little.
    assert (logits[0] - logits[1]).abs().max() < 0.05 * logits[0].abs().max()


def test_kv_pool_sized_by_max_total_tokens_and_page_size(platform, tiny_checkpoints):
    runner = make_runner(platform, tiny_checkpoints["qwen3"].plain, max_total_tokens=1000, page_size=16)
    assert runner.kv.total_tokens == 992  # whole pages only
    assert runner.kv.free_tokens == 992
    assert runner.describe()["kv_tokens"] == 992


def test_pool_smaller_than_one_request_is_a_clear_error(platform, tiny_checkpoints):
    with pytest.raises(KVPoolTooSmallError, match="--max-total-tokens"):
        make_runner(platform, tiny_checkpoints["llama"].plain, max_total_tokens=100)  # context length is 256


def test_unknown_architecture_lists_the_supported_ones(platform, tiny_checkpoints, tmp_path):
    source = tiny_checkpoints["llama"].plain
    for f in source.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["GPTNeoXForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="GPTNeoXForCausalLM.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        make_runner(platform, tmp_path)


def test_attention_backend_choice(platform, tiny_checkpoints):
    offered = platform.attention_backends()
    assert offered[-1] == "torch_native"
    runner = make_runner(platform, tiny_checkpoints["llama"].plain, attention_backend="torch_native")
    assert runner.attention.name == "torch_native"
    with pytest.raises(ConfigError, match="--decode-attention-backend 'nope' is not offered"):
        make_runner(platform, tiny_checkpoints["llama"].plain, decode_attention_backend="nope")


def test_idle_batch_and_sampling(platform, tiny_checkpoints):
    runner = make_runner(platform, tiny_checkpoints["llama"].plain)
    assert runner.forward(ForwardBatch.idle(runner.device)).shape == (0, 256)
    rows = [runner.kv.new_request() for _ in range(3)]
    batch = build_batch(runner.kv, rows, [0, 0, 0], [[1, 2, 3], [4, 5], [6]], runner.device)
    logits = runner.forward(batch)
    params = [SamplingParams(temperature=0), SamplingParams(seed=3, logprobs=2), SamplingParams(top_k=5, top_p=0.9)]
    out = runner.sample(logits, params, [0, 0, 0])
    assert out.token_ids.shape == (3,)
    assert out.token_ids[0] == logits[0].argmax()
    torch.testing.assert_close(out.logprobs[1], torch.log_softmax(logits[1].float(), -1)[out.token_ids[1]])
    again = runner.sample(logits[1:2], params[1:2], [0])
    assert again.token_ids[0] == out.token_ids[1]  # the seed decides, not the batch
