"""The decode graph runner on the xpu platform with the ipex backend: XPU graphs (the recording graph standing in for
torch.xpu.XPUGraph) replayed against eager, on a model whose head dim IPEX captures (64) in bf16."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from omnirun.batch import build_batch
from omnirun.testing import make_runner, randomize_constant_parameters

LANE = Path(__file__).resolve().parent / "fake_lane.py"


def _fake_platform():
    spec = importlib.util.spec_from_file_location("xpu_graph_test_fake_lane", LANE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.FakeXpuPlatform()


def test_graph_replay_equals_eager_through_ipex(install_ipex, tmp_path) -> None:
    from transformers import AutoModelForCausalLM, Qwen3Config

    ipex = install_ipex("xpu")
    config = Qwen3Config(
        hidden_size=128,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=256,
        max_position_embeddings=128,
        architectures=["Qwen3ForCausalLM"],
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize_constant_parameters(model, 0)
    model.save_pretrained(tmp_path)
    platform = _fake_platform()
    runner = make_runner(platform, tmp_path, dtype="bfloat16", max_running_requests=8, max_total_tokens=2048)
    try:
        assert runner.attention.name == "ipex" and runner.graph_runner is not None
        assert runner.graph_runner.graphs, "decode graphs were captured"
        prompts = [[(11 * i + j) % 256 for j in range(5 + 7 * i)] for i in range(3)]
        rows = [runner.kv.new_request() for _ in prompts]
        runner.forward(build_batch(runner.kv, rows, [0] * 3, prompts, runner.device))
        batch = build_batch(runner.kv, rows, [len(p) for p in prompts], [[7], [8], [9]], runner.device)
        assert runner.graph_runner.can_run(batch)
        calls = ipex.calls["flash_attn_varlen_func"]
        replayed = runner.forward(batch).clone()
        assert ipex.calls["flash_attn_varlen_func"] == calls, "a replay runs the recorded kernels, not new calls"
        eager = runner.forward_eager(batch)
        torch.testing.assert_close(replayed.float(), eager.float(), atol=3e-2, rtol=3e-2)
    finally:
        runner.close()
