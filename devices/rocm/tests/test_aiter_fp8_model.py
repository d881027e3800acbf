"""A tiny fp8 checkpoint on the rocm-fake lane's MI300X (fake aiter, CPU tensors): the linear layers keep the
checkpoint's e4m3fn weights (prepared in e4m3fnuz for aiter), prefill runs through aiter's W8A8 GEMMs (per tensor,
per channel, 128 x 128 blocks), decode steps through the reference (no Triton here: the platform's
`fp8_linear_takes` would dequantize such layers at load, so the test keeps them, to reach aiter), and the greedy
tokens are those HF's float32 model computes from the dequantized weights.

The comparison is honest for what runs: bf16 activations quantized to fp8 on the way cannot give HF's float32 logits,
so the tokens must be HF's own choices up to a near-tie (greedy_gap), the logits within the activation quantization
of the same bf16 model with its weights dequantized at load."""

from __future__ import annotations

import pytest
import torch

from omnirun import testing
from omnirun.batch import build_batch
from omnirun.devices.rocm.aiter_fp8 import WEIGHT_ONLY_MAX_ROWS, AiterFp8Weight, route
from omnirun.layers.linear import Linear
from omnirun.testing import greedy_gap, greedy_generate, hf_greedy, make_runner
from quantized_checkpoints import write_fp8_checkpoint

PROMPTS = [[(13 * i + 7 * j) % 256 for j in range(9 + 5 * i)] for i in range(3)]  # 9 + 14 + 19 tokens
NEW_TOKENS = 8
# (architecture, scale layout, layers kept, the GEMM they run). 128 x 128 blocks need layers of whole blocks: the
# tiny config is widened (hidden 128, MLP 256); k and v (64 rows) cut a block, so q|k|v is dequantized at load.
CASES = {
    "per-tensor": ("qwen3", None, 8, "gemm_a8w8_CK"),
    "per-channel": ("qwen2", "channel", 8, "gemm_a8w8_CK"),
    "block 128x128": ("llama", (128, 128), 6, "gemm_a8w8_blockscale"),
}


def _dequantizing(platform):
    """`platform` without its fp8 kernel: fp8 checkpoints are dequantized at load (the same bf16 model, exactly)."""

    class Dequantizes(type(platform)):
        def device_fused_ops(self):
            ops = dict(super().device_fused_ops())
            del ops["fp8_linear"], ops["prepare_fp8_linear"], ops["fp8_linear_takes"]
            return ops

    return Dequantizes()


def _keeping_without_triton(platform):
    """`platform` keeping every layer aiter's GEMMs take, although decode rows, without Triton here, run the
    reference (on a GPU the Triton weight-only kernel takes them, and the platform's own `fp8_linear_takes` holds)."""

    class Keeps(type(platform)):
        def device_fused_ops(self):
            ops = dict(super().device_fused_ops())
            ops["fp8_linear_takes"] = lambda n, k, block, dtype: (
                route(WEIGHT_ONLY_MAX_ROWS + 1, n, k, dtype, block, None) != "reference"
            )
            return ops

    return Keeps()


def _prefill_logits(runner) -> torch.Tensor:
    rows = [runner.kv.new_request() for _ in PROMPTS]
    batch = build_batch(runner.kv, rows, [0] * len(PROMPTS), PROMPTS, runner.device, return_full_logits=True)
    logits = runner.forward(batch).float()
    for row in rows:
        runner.kv.release(row)
    return logits


@pytest.mark.parametrize("case", CASES)
def test_an_fp8_checkpoint_keeps_fp8_layers_and_gives_hf_s_greedy_tokens(fake_rocm, aiter, tmp_path, monkeypatch, case):
    arch, block, kept_layers, gemm = CASES[case]
    if block == (128, 128):
        monkeypatch.setitem(testing._COMMON, "hidden_size", 128)
        monkeypatch.setitem(testing._COMMON, "intermediate_size", 256)
    hf, _ = write_fp8_checkpoint(tmp_path, arch, block)
    assert sum(map(len, PROMPTS)) > WEIGHT_ONLY_MAX_ROWS  # prefill quantizes its activations, decode does not
    runner = make_runner(_keeping_without_triton(fake_rocm), tmp_path, dtype="bfloat16", max_running_requests=4)
    dequantized = make_runner(_dequantizing(fake_rocm), tmp_path, dtype="bfloat16", disable_graph=True)
    try:
        linears = [m for m in runner.model.modules() if isinstance(m, Linear) and m.fp8 is not None]
        assert len(linears) == kept_layers
        assert f"{kept_layers} linear layers kept in fp8" in runner.describe()["weights"]
        for linear in linears:  # the loaded e4m3fn tensors stay; aiter reads their fnuz form
            assert linear.weight.dtype == torch.float8_e4m3fn
            assert isinstance(linear.prepared, AiterFp8Weight)
            assert linear.prepared.weight.dtype == torch.float8_e4m3fnuz
        logits = _prefill_logits(runner)
        assert aiter.calls[gemm] == kept_layers  # every kept layer, once, in the prefill
        expected = _prefill_logits(dequantized)
        assert (logits - expected).abs().max() < 0.05 * expected.abs().max()  # fp8 activations: a little off
        tokens = greedy_generate(runner, PROMPTS, NEW_TOKENS)
        for prompt, got in zip(PROMPTS, tokens, strict=True):
            if got != hf_greedy(hf, prompt, NEW_TOKENS):
                gap, scale = greedy_gap(hf, prompt, got)
                assert gap <= 2**-5 * scale, f"token off HF's argmax by {gap} (logits up to {scale})"
    finally:
        runner.close()
        dequantized.close()
