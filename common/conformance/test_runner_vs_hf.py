"""The runner against HF transformers on tiny random checkpoints of every supported architecture (float32)."""

from __future__ import annotations

import pytest
import torch

from omnirun.batch import build_batch
from omnirun.testing import ARCHITECTURES, greedy_generate, hf_greedy, make_runner

PROMPT_LEN = 40  # longer than the sliding windows (16) of the qwen2/mistral configs
NEW_TOKENS = 32


def _prompt(seed: int, length: int = PROMPT_LEN) -> list[int]:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def runners(tiny_checkpoints, platform):
    """One runner per (architecture, page size, checkpoint layout), built once."""
    cache = {}

    def get(arch: str, page_size: int, layout: str = "plain"):
        key = (arch, page_size, layout)
        if key not in cache:
            checkpoint = getattr(tiny_checkpoints[arch], layout)
            cache[key] = make_runner(platform, checkpoint, page_size=page_size)
        return cache[key]

    return get


def _prefill_logits(runner, prompt):
    row = runner.kv.new_request()
    try:
        batch = build_batch(runner.kv, [row], [0], [prompt], runner.device, return_full_logits=True)
        return runner.forward(batch).float()
    finally:
        runner.kv.release(row)


@pytest.mark.parametrize("layout", ["plain", "sharded"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_prefill_logits_match_hf(arch, page_size, layout, runners, tiny_checkpoints):
    runner = runners(arch, page_size, layout)
    prompt = _prompt(0)
    hf = tiny_checkpoints[arch].hf_model
    with torch.no_grad():
        expected = hf(torch.tensor([prompt], device=runner.device)).logits[0].float()
    torch.testing.assert_close(_prefill_logits(runner, prompt), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_tokens_match_hf_generate(arch, page_size, runners, tiny_checkpoints):
    runner = runners(arch, page_size)
    prompt = _prompt(1)
    expected = hf_greedy(tiny_checkpoints[arch].hf_model, prompt, NEW_TOKENS)
    assert greedy_generate(runner, [prompt], NEW_TOKENS) == [expected]


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_batch_of_ragged_requests_equals_each_alone(arch, page_size, runners):
    runner = runners(arch, page_size)
    free_before = runner.kv.free_tokens
    prompts = [_prompt(10 + i, length) for i, length in enumerate((3, 40, 17, 1, 29))]
    together = greedy_generate(runner, prompts, 12)
    alone = [greedy_generate(runner, [p], 12)[0] for p in prompts]
    assert together == alone
    assert runner.kv.free_tokens == free_before


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_chunked_prefill_and_cached_prefix_match_one_shot(arch, page_size, runners):
    runner = runners(arch, page_size)
    prompt = _prompt(2)
    one_shot = _prefill_logits(runner, prompt)

    # The same prompt in chunks of 7, each attending to what the earlier chunks cached; the full logits of
    # every chunk, put together, must be the one-shot prefill's.
    row = runner.kv.new_request()
    try:
        pieces, cached = [], 0
        while cached < len(prompt):
            chunk = prompt[cached : cached + 7]
            batch = build_batch(runner.kv, [row], [cached], [chunk], runner.device, return_full_logits=True)
            pieces.append(runner.forward(batch).float())
            cached += len(chunk)
    finally:
        runner.kv.release(row)
    torch.testing.assert_close(torch.cat(pieces), one_shot, atol=1e-5, rtol=0)

    # Prefix reuse: a prefix cached by an earlier step, then the rest of the prompt together with another request.
    row, other = runner.kv.new_request(), runner.kv.new_request()
    try:
        prefix = build_batch(runner.kv, [row], [0], [prompt[:25]], runner.device)
        runner.forward(prefix)
        other_prompt = _prompt(3, 9)
        batch = build_batch(
            runner.kv, [other, row], [0, 25], [other_prompt, prompt[25:]], runner.device, return_full_logits=True
        )
        logits = runner.forward(batch).float()
    finally:
        runner.kv.release(row)
        runner.kv.release(other)
    torch.testing.assert_close(logits[len(other_prompt) :], one_shot[25:], atol=1e-5, rtol=0)
    torch.testing.assert_close(logits[: len(other_prompt)], _prefill_logits(runner, other_prompt), atol=1e-5, rtol=0)
