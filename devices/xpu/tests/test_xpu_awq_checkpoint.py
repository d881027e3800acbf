"""A tiny AWQ checkpoint on the registered xpu platform (a real Intel GPU, or the xpu-fake lane's stand-in): its
linear layers keep the packed int4 weights, IPEX's kernel runs those it takes (ipex_int4.py), and the model follows
HF's float32 model on the dequantized weights. Skipped where the xpu platform has no IPEX with int4 linears.

The comparison is in bfloat16, the dtype IPEX computes in (float32 rows go to the fallback), against float32 HF:
logits within BF16_ATOL, and teacher-forced along HF's greedy tokens, omnirun's pick is HF's token wherever HF's
own top-two margin is wider than twice that (a narrower margin is a tie within bfloat16's rounding, not the
model's choice)."""

from __future__ import annotations

import pytest
import torch

import omnirun.testing
from omnirun.batch import build_batch
from omnirun.devices.xpu.ipex_int4 import IpexInt4
from omnirun.kernels import offers_triton
from omnirun.layers import prepared
from omnirun.layers.linear import Linear
from omnirun.testing import hf_greedy, make_runner
from quantized_checkpoints import PROMPTS, write_int4_checkpoint

pytestmark = pytest.mark.device("xpu")

BF16_ATOL = 0.015  # logits up to ~0.9, bfloat16's step there 0.004: measured 0.003 to 0.006 on the fake lane
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def xpu():
    from omnirun.registry import default_registry

    platform = default_registry().platforms["xpu"]
    if "prepare_int4_linear" not in platform.device_fused_ops():
        pytest.skip(f"needs IPEX's int4 linear on xpu: {'; '.join(platform.notes()) or 'IPEX is not installed'}")
    return platform


def _logits_along(runner, sequences: list[list[int]]) -> list[torch.Tensor]:
    """Every position's float32 logits of each sequence, prefilled together."""
    rows = [runner.kv.new_request() for _ in sequences]
    batch = build_batch(runner.kv, rows, [0] * len(sequences), sequences, runner.device)
    batch.return_full_logits = True
    return list(runner.forward(batch).float().cpu().split([len(s) for s in sequences]))


@pytest.mark.parametrize(
    "arch, group_size, hidden",
    # hidden 64: down_proj (K 128) to IPEX, the K 64 layers (K not a multiple of 128) to the fallback: Triton's
    # kernel where the platform runs Triton, else (this lane) dequantized at load; hidden 128: every layer to IPEX,
    # qwen2's q|k|v with its bias.
    [("llama", 32, 64), ("qwen2", 128, 128)],
)
def test_awq_checkpoint_keeps_int4_and_follows_hf(monkeypatch, tmp_path, xpu, arch, group_size, hidden) -> None:
    monkeypatch.setitem(omnirun.testing._COMMON, "hidden_size", hidden)
    monkeypatch.setitem(omnirun.testing._COMMON, "intermediate_size", 2 * hidden)
    hf, _ = write_int4_checkpoint(tmp_path, arch, "awq", group_size)
    runner = make_runner(xpu, tmp_path, dtype="bfloat16")
    try:
        everything = [m for m in runner.model.modules() if isinstance(m, Linear) and m is not runner.model.lm_head]
        linears = [m for m in everything if m.int4 is not None]
        triton = offers_triton(xpu.capabilities)
        assert linears == [m for m in everything if triton or m.in_features % 128 == 0]
        assert f"{len(linears)} linear layers kept in int4" in runner.describe()["weights"]
        on_ipex = [m.in_features for m in linears if isinstance(m.prepared, IpexInt4)]
        assert on_ipex == [m.in_features for m in linears if m.in_features % 128 == 0] and on_ipex
        want = [hf_greedy(hf, prompt, NEW_TOKENS) for prompt in PROMPTS]
        sequences = [prompt + tokens for prompt, tokens in zip(PROMPTS, want, strict=True)]
        decided = 0
        for prompt, sequence, logits in zip(PROMPTS, sequences, _logits_along(runner, sequences), strict=True):
            with torch.no_grad():
                expected = hf(torch.tensor([sequence])).logits[0].float()
            torch.testing.assert_close(logits, expected, atol=BF16_ATOL, rtol=0)
            steps = slice(len(prompt) - 1, len(sequence) - 1)  # the positions that chose HF's new tokens
            top2 = expected[steps].topk(2, dim=-1).values
            clear = (top2[:, 0] - top2[:, 1]) > 2 * BF16_ATOL
            picked, hf_tokens = logits[steps].argmax(-1), torch.tensor(sequence[steps.start + 1 :])
            assert torch.equal(picked[clear], hf_tokens[clear])
            decided += int(clear.sum())
        assert decided >= len(PROMPTS) * NEW_TOKENS // 2, "too few positions with a clear choice to compare"
    finally:
        runner.close()


def test_layers_on_ipex_leave_their_loaded_words_in_host_memory(monkeypatch, tmp_path, xpu) -> None:
    """IPEX's module holds its own copy (IpexInt4.reads_loaded_tensors False): a layer on IPEX sends its loaded words
    to host memory, the others keep theirs on the device, and the logits are those with every word on the device.
    "meta" plays host memory here (on the fake lane the device is the host): a kernel that read it would fail."""
    monkeypatch.setitem(omnirun.testing._COMMON, "hidden_size", 64)
    monkeypatch.setitem(omnirun.testing._COMMON, "intermediate_size", 128)
    write_int4_checkpoint(tmp_path, "llama", "awq", 32)
    logits = {}
    for host in ("cpu", "meta"):
        monkeypatch.setattr(prepared, "HOST", torch.device(host))
        runner = make_runner(xpu, tmp_path, dtype="bfloat16")
        try:
            linears = [m for m in runner.model.modules() if isinstance(m, Linear) and m.int4 is not None]
            assert any(isinstance(m.prepared, IpexInt4) for m in linears)
            for m in linears:
                where = host if isinstance(m.prepared, IpexInt4) else runner.device.type
                assert m.weight_packed.device.type == m.weight_scale.device.type == where
            logits[host] = _logits_along(runner, PROMPTS)
        finally:
            runner.close()
    for on_device, on_host in zip(logits["cpu"], logits["meta"], strict=True):
        assert torch.equal(on_device, on_host)
