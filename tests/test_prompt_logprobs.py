"""Prompt logprobs (SamplingParams.prompt_logprobs) against HF transformers' log_softmax of the prompt on a tiny
random model in float32: chunked prefill, a prefix the cache already holds, other requests in the same batches."""

from __future__ import annotations

import pytest
import torch

from omnirun import LLM
from omnirun.sampling import SamplingParams
from omnirun.testing import hf_greedy, tiny_hf_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    hf = tiny_hf_model("qwen2")  # a sliding window (16) shorter than the prompts
    path = tmp_path_factory.mktemp("qwen2")
    hf.save_pretrained(path)
    return hf, path


def _llm(path, **flags) -> LLM:
    return LLM(model=str(path), device="cpu", dtype="float32", max_total_tokens=4096, progress=False, **flags)


def _prompt(seed: int, length: int = 40) -> list[int]:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _hf_logprobs(hf, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)


def _check(output, hf, prompt: list[int], n_top: int) -> None:
    expected = _hf_logprobs(hf, prompt)[:-1]  # position p scores token p + 1
    assert output.prompt_logprobs[0] is None and len(output.prompt_logprobs) == len(prompt)
    chosen = expected.gather(-1, torch.tensor(prompt[1:]).unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(torch.tensor(output.prompt_logprobs[1:]), chosen, atol=1e-5, rtol=0)
    top = expected.topk(n_top, dim=-1)
    assert output.prompt_top_logprobs[0] is None
    assert [[t for t, _ in step] for step in output.prompt_top_logprobs[1:]] == top.indices.tolist()
    got = torch.tensor([[v for _, v in step] for step in output.prompt_top_logprobs[1:]])
    torch.testing.assert_close(got, top.values, atol=1e-5, rtol=0)


@pytest.mark.parametrize("chunk", [None, 16], ids=["one_prefill", "chunks_of_16"])
def test_prompt_logprobs_equal_hf_log_softmax(model, chunk):
    hf, path = model
    llm = _llm(path, chunked_prefill_size=chunk)
    try:
        prompt = _prompt(0)
        params = SamplingParams(max_new_tokens=4, temperature=0, prompt_logprobs=3)
        (output,) = llm.generate([prompt], params, use_tqdm=False)
        _check(output, hf, prompt, 3)
        assert output.token_ids == hf_greedy(hf, prompt, 4)
    finally:
        llm.close()


def test_a_prefix_in_the_cache_is_recomputed_for_its_logprobs(model):
    hf, path = model
    llm = _llm(path, page_size=4)
    try:
        shared = _prompt(1, 32)
        llm.generate([shared + _prompt(2, 8)], SamplingParams(max_new_tokens=1, temperature=0), use_tqdm=False)
        prompt = shared + _prompt(3, 8)
        (plain,) = llm.generate([prompt], SamplingParams(max_new_tokens=1, temperature=0), use_tqdm=False)
        assert plain.cached_tokens == 32  # the cache holds the prefix
        params = SamplingParams(max_new_tokens=1, temperature=0, prompt_logprobs=2)
        (output,) = llm.generate([prompt], params, use_tqdm=False)
        assert output.cached_tokens == 0
        _check(output, hf, prompt, 2)
    finally:
        llm.close()


def test_requests_without_prompt_logprobs_share_the_batches(model):
    """Three prompts in one call, chunked: only the middle one wants prompt logprobs (0: its tokens' only);
    everyone's greedy tokens are HF's."""
    hf, path = model
    llm = _llm(path, chunked_prefill_size=24)
    try:
        prompts = [_prompt(4, 30), _prompt(5, 45), _prompt(6, 20)]
        params = [
            SamplingParams(max_new_tokens=5, temperature=0),
            SamplingParams(max_new_tokens=5, temperature=0, prompt_logprobs=0),
            SamplingParams(max_new_tokens=5, temperature=0),
        ]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.token_ids for o in outputs] == [hf_greedy(hf, p, 5) for p in prompts]
        assert outputs[0].prompt_logprobs is None and outputs[1].prompt_top_logprobs is None
        expected = _hf_logprobs(hf, prompts[1])[:-1].gather(-1, torch.tensor(prompts[1][1:]).unsqueeze(-1))
        torch.testing.assert_close(
            torch.tensor(outputs[1].prompt_logprobs[1:]), expected.squeeze(-1), atol=1e-5, rtol=0
        )
    finally:
        llm.close()


def test_max_new_tokens_0_returns_the_prompt_s_logprobs_and_no_token(model):
    hf, path = model
    llm = _llm(path)
    try:
        prompt = _prompt(7, 12)
        (output,) = llm.generate([prompt], SamplingParams(max_new_tokens=0, prompt_logprobs=1), use_tqdm=False)
        assert output.token_ids == [] and output.finish_reason == "length"
        _check(output, hf, prompt, 1)
    finally:
        llm.close()
