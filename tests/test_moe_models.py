"""Mixture-of-experts models on the CPU beyond the conformance suite's HF parity (common/conformance/test_moe_vs_hf.py):
the `fused_moe` reference against a per-token loop, expert-parallel refusals, the bytes a decode step reads."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from omnirun.layers import native_ops
from omnirun.registry import select_platform
from omnirun.testing import MOE_ARCHITECTURES, greedy_generate, hf_greedy, make_runner, tiny_hf_model


@pytest.fixture(scope="module", params=MOE_ARCHITECTURES)
def checkpoint(request, tmp_path_factory):
    hf = tiny_hf_model(request.param)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return request.param, hf, path


def _prompt(seed: int, length: int = 40) -> list[int]:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _per_token(x, logits, w13, w2, top_k, renormalize):
    """The mixture written the obvious way: one token at a time, float64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        probs = torch.softmax(logits[t].double(), -1)
        weights, experts = probs.topk(top_k)
        if renormalize:
            weights = weights / weights.sum()
        for w, e in zip(weights.tolist(), experts.tolist(), strict=True):
            gate, up = (w13[e].double() @ x[t].double()).chunk(2)
            out[t] += w * (w2[e].double() @ (F.silu(gate) * up))
    return out


@pytest.mark.parametrize("renormalize", [True, False])
def test_fused_moe_reference_equals_a_per_token_loop(renormalize):
    """Six experts: one gets every token (a large router bias), one none (a large negative one), one a single token."""
    gen = torch.Generator().manual_seed(3)
    tokens, hidden, inter, experts = 9, 16, 8, 6
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) / 4
    w2 = torch.randn(experts, hidden, inter, generator=gen) / 4
    logits = torch.randn(tokens, experts, generator=gen)
    logits[:, 0] += 20.0  # every token
    logits[:, 5] -= 20.0  # no token
    logits[:, 4] -= 20.0
    logits[3, 4] += 40.0  # one token
    got = native_ops.fused_moe(x, logits, w13, w2, 2, renormalize)
    expected = _per_token(x, logits, w13, w2, 2, renormalize)
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)


def test_expert_parallelism_is_refused_in_one_line_where_it_cannot_split():
    from omnirun.cli_flags import add_runner_flags, llm_kwargs
    from omnirun.errors import ConfigError
    from omnirun.models.architecture import decoder_shape
    from omnirun.models.tp_layout import tp_layout
    from omnirun.testing import tiny_configs, tiny_moe_configs

    moe = decoder_shape(tiny_moe_configs()["qwen2_moe"])  # 6 experts
    with pytest.raises(ConfigError, match="^--tp-size 4 does not divide the model's 6 experts.*use one of 1, 2, 3, 6$"):
        tp_layout(moe, 4, 0, expert_parallel=True)
    with pytest.raises(ConfigError, match="needs a mixture-of-experts model"):
        tp_layout(decoder_shape(tiny_configs()["llama"]), 2, 0, expert_parallel=True)
    layout = tp_layout(moe, 2, 1, expert_parallel=True)
    assert (layout.expert_start, layout.experts_per_rank) == (3, 3)
    import argparse

    parser = argparse.ArgumentParser()
    add_runner_flags(parser)
    assert llm_kwargs(parser.parse_args(["--enable-expert-parallel"]))["enable_expert_parallel"] is True


def test_a_decode_step_reads_the_experts_its_batch_is_expected_to_reach(checkpoint):
    """Top-2 of E experts: at batch 1 a step reads 2/E of the experts' bytes, more as the batch grows, all of them
    only in the limit; the rest of the model whole at any batch."""
    _, _, path = checkpoint
    runner = make_runner(select_platform("cpu"), path)
    try:
        experts = [m for m in runner.model.modules() if type(m).__name__ == "SparseMoE"]
        expert_bytes = sum((m.w13.numel() + m.w2.numel()) * 4 for m in experts)
        whole = runner.weight_bytes_per_step(10**6)
        top_k, count = experts[0].top_k, experts[0].num_experts
        assert whole - runner.weight_bytes_per_step(1) == pytest.approx(expert_bytes * (1 - top_k / count), abs=8)
        assert runner.weight_bytes_per_step(1) < runner.weight_bytes_per_step(8) < whole
    finally:
        runner.close()


def test_the_graph_reserve_holds_every_slot_of_a_mixture_of_experts():
    """Mixtral-8x7B: each token's 2 expert slots hold twice the gate|up activations its intermediate size (14336)
    alone would: the reserve for captured graphs must count the slots."""
    from types import SimpleNamespace

    from omnirun.graphs import DecodeGraphRunner
    from omnirun.loader.presets import PRESETS
    from omnirun.models.architecture import decoder_shape

    shape = decoder_shape(PRESETS["mixtral-8x7b"].build())
    one_slot = 256 * 4 * shape.moe.intermediate_size * 2  # gate|up and activation, bf16, batch 256
    dense_runner = SimpleNamespace(shape=dataclasses.replace(shape, moe=None), dtype=torch.bfloat16)
    dense = DecodeGraphRunner(dense_runner, None, 256).reserved_bytes()
    experts = DecodeGraphRunner(SimpleNamespace(shape=shape, dtype=torch.bfloat16), None, 256).reserved_bytes()
    assert experts - dense >= 2 * (shape.moe.top_k - 1) * one_slot  # the reserve's 2x margin over one more slot


def test_weights_of_another_checkpoint_replace_every_expert(tmp_path):
    """update_weights_from_disk reads per-expert tensors into the stacked experts like the loader does: afterwards
    the runner gives what a runner started on the new checkpoint gives."""
    old, new = tmp_path / "old", tmp_path / "new"
    tiny_hf_model("mixtral", seed=1).save_pretrained(old)
    hf = tiny_hf_model("mixtral", seed=2)
    hf.save_pretrained(new)
    runner = make_runner(select_platform("cpu"), old)
    try:
        prompt = _prompt(3, 12)
        before = greedy_generate(runner, [prompt], 8)
        runner.update_weights_from_disk(str(new))
        after = greedy_generate(runner, [prompt], 8)
        assert after == [hf_greedy(hf, prompt, 8)] and after != before
        expert = runner.get_weights_by_name("model.layers.1.block_sparse_moe.experts.5.w3.weight")
        inter = hf.config.intermediate_size  # HF holds the experts stacked too: [E, gate | up, H]
        assert torch.equal(expert, hf.state_dict()["model.layers.1.mlp.experts.gate_up_proj"][5, inter:])
    finally:
        runner.close()
