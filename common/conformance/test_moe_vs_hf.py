"""Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE) on the platform under test, through its own
`fused_moe` and, where it captures graphs, its decode graphs: against HF transformers (float32), and graph replay
against eager in the device's half dtype."""

from __future__ import annotations

import pytest
import torch

from omnirun.batch import build_batch
from omnirun.testing import (
    MOE_ARCHITECTURES,
    greedy_generate,
    hf_greedy,
    make_runner,
    replayed_and_eager,
    tiny_hf_model,
)


@pytest.fixture(scope="module", params=MOE_ARCHITECTURES)
def checkpoint(request, tmp_path_factory, platform):
    hf = tiny_hf_model(request.param)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return request.param, hf.to(platform.device()), path


def _prompt(seed: int, length: int = 40) -> list[int]:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("page_size", [1, 16])
def test_prefill_logits_and_greedy_tokens_equal_hf(platform, checkpoint, page_size):
    arch, hf, path = checkpoint
    runner = make_runner(platform, path, page_size=page_size)
    try:
        prompt = _prompt(0)
        row = runner.kv.new_request()
        batch = build_batch(runner.kv, [row], [0], [prompt], runner.device, return_full_logits=True)
        logits = runner.forward(batch).float()
        runner.kv.release(row)
        with torch.no_grad():
            expected = hf(torch.tensor([prompt], device=runner.device)).logits[0].float()
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0, msg=arch)
        prompts = [_prompt(1), _prompt(2, 7)]
        assert greedy_generate(runner, prompts, 16) == [hf_greedy(hf, p, 16) for p in prompts]
        experts = {"mixtral": 8, "qwen2_moe": 6, "qwen3_moe": 8}[arch]
        assert runner.describe()["experts"].startswith(f"top 2 of {experts}, every expert whole, fused_moe ")
    finally:
        runner.close()


@pytest.mark.parametrize("batch_size", [1, 3, 8])  # 3 replays the graph of 4, padded
def test_graph_replay_equals_eager(platform, checkpoint, batch_size):
    """The routing, the slot sort and both grouped GEMMs replayed from a graph: no step may read the routing on the
    host, and a padded graph batch must not change what the real rows get."""
    halves = [d for d in platform.capabilities.model_dtypes if d.itemsize == 2]
    dtype = str(halves[0]).removeprefix("torch.") if halves else "float32"
    _, _, path = checkpoint
    runner = make_runner(platform, path, max_running_requests=16, dtype=dtype)
    try:
        if runner.graph_runner is None:
            pytest.skip(f"{platform.name} builds no graph runner for this model in {dtype}: every step runs eagerly")
        replayed, eager = replayed_and_eager(runner, [_prompt(10 + i, 5 + 7 * i) for i in range(batch_size)])
        tolerance = 1e-4 if dtype == "float32" else 3e-2
        torch.testing.assert_close(replayed.float(), eager.float(), atol=tolerance, rtol=tolerance)
    finally:
        runner.close()
