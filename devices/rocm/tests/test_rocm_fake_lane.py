"""The rocm-fake lane's platform and a whole runner on it: aiter is its default for bf16/fp16 models (RocmPlatform
keeps aiter on request), float32 models get RocmPlatform's default, and a bf16 runner decodes through aiter in
recorded HIP graphs, matching the same runner on torch_native and HF transformers. Runs in every lane (CPU tensors)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from omnirun.batch import build_batch
from omnirun.testing import greedy_generate, make_runner, tiny_hf_model

PROMPTS = [[(11 * i + j) % 256 for j in range(3 + 9 * i)] for i in range(3)]


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    """A tiny qwen2 (sliding windows of 16 on some layers) saved once; the HF model is the float32 reference."""
    model = tiny_hf_model("qwen2")
    root = tmp_path_factory.mktemp("qwen2")
    model.save_pretrained(root)
    return root, model


def test_aiter_is_the_lanes_default_for_half_dtypes_only(fake_rocm):
    assert fake_rocm.attention_backends() == ("aiter", "torch_native")  # no triton on CPU tensors
    for mode in ("prefill", "decode"):
        assert fake_rocm.default_attention_backend_for(mode, torch.bfloat16) == "aiter"
        assert fake_rocm.default_attention_backend_for(mode, torch.float16) == "aiter"
        assert fake_rocm.default_attention_backend_for(mode, torch.float32) == "torch_native"
    assert fake_rocm.capabilities.fp8_e4m3_dtype == torch.float8_e4m3fnuz  # an MI300X (gfx942)
    assert fake_rocm.capabilities.device_name == "AMD Instinct MI300X (gfx942)"
    assert set(fake_rocm.device_fused_ops()) == {
        "rms_norm",
        "add_rms_norm",
        "fp8_linear",
        "prepare_fp8_linear",
        "fp8_linear_takes",
    }


def test_a_float32_runner_runs_eagerly_on_torch_native(fake_rocm, qwen2):
    runner = make_runner(fake_rocm, qwen2[0], max_running_requests=4)
    assert runner.attention.name == "torch_native" and runner.graph_runner is None


def test_a_bf16_runner_decodes_through_aiter_in_hip_graphs(fake_rocm, aiter, qwen2):
    root, hf = qwen2
    runner = make_runner(fake_rocm, root, max_running_requests=4, dtype="bfloat16")
    assert runner.attention.name == "aiter" and runner.graph_runner.api.name == "hip_graph"
    assert sorted(runner.graph_runner.graphs) == [1, 2, 4]  # max_running_requests 4
    reference = make_runner(fake_rocm, root, dtype="bfloat16", attention_backend="torch_native", disable_graph=True)
    # The prefill logits of each against HF in float32, to bf16's precision.
    row = runner.kv.new_request()
    batch = build_batch(runner.kv, [row], [0], [PROMPTS[2]], runner.device, return_full_logits=True)
    logits = runner.forward(batch).float()
    runner.kv.release(row)
    with torch.no_grad():
        expected = hf(torch.tensor([PROMPTS[2]])).logits[0].float()
    torch.testing.assert_close(logits, expected, atol=5e-2, rtol=0)
    replays = sum(graph.replays for graph, _, _ in runner.graph_runner.graphs.values())
    calls = aiter.calls["paged_attention_ragged"]
    got = greedy_generate(runner, PROMPTS, 10)
    assert got == greedy_generate(reference, PROMPTS, 10)
    # Every decode step replayed a graph (3 requests in the graph of 4); none called aiter's decode from Python.
    assert sum(graph.replays for graph, _, _ in runner.graph_runner.graphs.values()) - replays == 9
    assert aiter.calls["paged_attention_ragged"] == calls
    assert aiter.calls["flash_attn_varlen_func"] > 0 and aiter.calls["rmsnorm2d_fwd_with_add"] > 0


def test_a_graph_replay_fills_its_inputs_from_the_packed_copy_or_field_by_field(fake_rocm, aiter, qwen2):
    """A decode batch straight from build_batch is copied in one go (its packed device ints); one whose fields were
    replaced is copied field by field. Both replays equal the eager step on the same batch, padding included."""
    runner = make_runner(fake_rocm, qwen2[0], max_running_requests=4, dtype="bfloat16")
    rows = [runner.kv.new_request() for _ in PROMPTS]
    runner.forward(build_batch(runner.kv, rows, [0] * 3, PROMPTS, runner.device))
    lens = [len(p) for p in PROMPTS]
    # 3 requests in the graph of 4, then 2 (new tokens, lengths and slots) in the graph of 2.
    for step_rows, by_fields, token in ((rows, False, 5), (rows[1:], True, 9)):
        step_lens = [lens[rows.index(r)] for r in step_rows]
        batch = build_batch(runner.kv, step_rows, step_lens, [[token]] * len(step_rows), runner.device)
        if by_fields:
            batch = dataclasses.replace(batch, input_ids=batch.input_ids.clone(), positions=batch.positions.clone())
        assert (batch.decode_inputs() is None) == by_fields
        replays = sum(graph.replays for graph, _, _ in runner.graph_runner.graphs.values())
        got = runner.forward(batch).float()
        assert sum(graph.replays for graph, _, _ in runner.graph_runner.graphs.values()) == replays + 1
        torch.testing.assert_close(got, runner.forward_eager(batch).float(), atol=2e-2, rtol=0)
        for r in step_rows:
            lens[rows.index(r)] += 1


def test_a_smaller_batch_in_a_graph_pads_its_rows_rather_than_replaying_stale_ones(fake_rocm, aiter, qwen2):
    """After 4 requests filled a graph of 4, 3 requests replay it: the fourth row must be the dummy request, not the
    last one's inputs, whose slot a new request may own by now (the allocator hands freed pages out first)."""
    root = qwen2[0]
    runners = [
        make_runner(fake_rocm, root, max_running_requests=4, dtype="bfloat16"),
        make_runner(fake_rocm, root, max_running_requests=4, dtype="bfloat16", disable_graph=True),
    ]
    prompts = [*PROMPTS, [7, 8, 9, 10]]
    last_logits = []
    for runner in runners:  # the same steps on both: slots come out the same
        kv = runner.kv
        rows = [kv.new_request() for _ in prompts]
        lens = [len(p) for p in prompts]
        runner.forward(build_batch(kv, rows, [0] * 4, prompts, runner.device))
        runner.forward(build_batch(kv, rows, lens, [[5]] * 4, runner.device))  # the graph of 4, full
        kv.release(rows[3])  # its 5 slots, the newest one included, go back on top of the free list
        new_row = kv.new_request()
        runner.forward(build_batch(kv, [new_row], [0], [[3, 1, 4, 1, 5]], runner.device))  # takes those slots
        runner.forward(build_batch(kv, rows[:3], [n + 1 for n in lens[:3]], [[6]] * 3, runner.device))  # 3 of 4
        last_logits.append(runner.forward(build_batch(kv, [new_row], [5], [[2]], runner.device)).float())
    assert runners[0].graph_runner is not None and runners[1].graph_runner is None
    torch.testing.assert_close(last_logits[0], last_logits[1], atol=2e-2, rtol=0)
