"""int4_linear on npu_weight_quant_batchmatmul, over the fake torch_npu (which computes what the docs give and
refuses what they rule out): the op against the reference, the limits where the reference runs instead, and an AWQ
checkpoint loaded on the npu platform (npu-fake lane, or a real Ascend).

Tolerance: the kernel antiquantizes in x's dtype ((q + offset) * scale, the scale rounded to it) where the reference
rounds the float32 weight once, and both round the output: at most 2 units of the dtype's resolution (eps) of the
output's magnitude apart.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from omnirun.devices.npu.ascend_quant import AscendInt4Weight, ascend_int4_ops
from omnirun.devices.npu.platform import INT4_NOTE
from omnirun.layers import native_ops
from omnirun.layers.linear import Linear
from omnirun.registry import get_platform
from omnirun.testing import greedy_gap, greedy_generate, hf_greedy, make_runner, replayed_and_eager
from quantized_checkpoints import PROMPTS, prefill_logits, write_int4_checkpoint, write_pack_quantized_checkpoint

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import fake_torch_npu as fake  # noqa: E402

A2 = "Ascend910B3"


def _counted(monkeypatch, torch_npu) -> list[int]:
    """Counts the kernel's calls (the op reads the attribute on each call)."""
    calls = []
    kernel = torch_npu.npu_weight_quant_batchmatmul
    monkeypatch.setattr(torch_npu, "npu_weight_quant_batchmatmul", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    return calls


def _int4_weight(n: int, k: int, group_size: int, symmetric: bool = False, seed: int = 0):
    """Our kept layout: int32 [N, K / 8] (value 8c + i in bits 4i.. of word c), float32 scales, uint8 zeros."""
    gen = torch.Generator().manual_seed(seed)
    groups = -(-k // group_size)
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
    words = (q.view(n, k // 8, 8).long() << torch.arange(0, 32, 4)).sum(-1)
    packed = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    scale = torch.rand(n, groups, generator=gen) * 0.02 + 1e-3
    zero = torch.full((n, groups), 8, dtype=torch.uint8)
    if not symmetric:
        zero = torch.randint(0, 16, (n, groups), generator=gen, dtype=torch.uint8)
    return packed, scale, zero


def _assert_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.dtype == expected.dtype and got.shape == expected.shape
    error = (got.float() - expected.float()).abs().max()
    assert error <= 2 * torch.finfo(expected.dtype).eps * expected.float().abs().max(), float(error)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("rows", [1, 7])
@pytest.mark.parametrize(
    ("k", "group_size", "kernel_group", "symmetric"),
    [
        (256, 32, 32, False),  # per group
        (256, 128, 128, False),
        (200, 32, 32, True),  # a partial last group; every zero 8: no offset
        (128, 128, 0, False),  # one group per row: per channel
    ],
    ids=["g32", "g128", "g32-partial-sym", "g128-per-channel"],
)
def test_int4_linear_runs_the_kernel_and_matches_the_reference(
    torch_npu, monkeypatch, dtype, rows, k, group_size, kernel_group, symmetric
):
    ops = ascend_int4_ops(torch_npu, A2)
    calls = _counted(monkeypatch, torch_npu)
    n = 96
    packed, scale, zero = _int4_weight(n, k, group_size, symmetric)
    prepared = ops["prepare_int4_linear"](packed, scale, zero, group_size)
    assert isinstance(prepared, AscendInt4Weight) and prepared.group_size == kernel_group
    assert prepared.weight.dtype == torch.int32 and prepared.weight.shape == (k, n // 8)
    assert (prepared.antiquant[dtype][1] is None) == symmetric
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    for bias in (None, torch.randn(n, generator=gen).to(dtype)):
        got = ops["int4_linear"](x, packed, scale, zero, bias, group_size, prepared)
        _assert_close(got, native_ops.int4_linear(x, packed, scale, zero, bias, group_size))
    assert len(calls) == 2


def test_a_3d_input_keeps_its_leading_dims(torch_npu):
    ops = ascend_int4_ops(torch_npu, A2)
    packed, scale, zero = _int4_weight(32, 64, 32)
    prepared = ops["prepare_int4_linear"](packed, scale, zero, 32)
    x = torch.randn(2, 3, 64).to(torch.bfloat16)
    got = ops["int4_linear"](x, packed, scale, zero, None, 32, prepared)
    _assert_close(got, native_ops.int4_linear(x, packed, scale, zero, None, 32))


@pytest.mark.parametrize(
    ("n", "k", "group_size"),
    [(96, 256, 16), (36, 64, 32), (8, 65536, 65536)],
    ids=["groups-of-16", "n-not-8-aligned", "k-over-65535"],
)
def test_layers_the_kernel_cannot_take_are_not_prepared_and_run_the_reference(torch_npu, monkeypatch, n, k, group_size):
    ops = ascend_int4_ops(torch_npu, A2)
    calls = _counted(monkeypatch, torch_npu)
    packed, scale, zero = _int4_weight(n, k, group_size)
    assert ops["prepare_int4_linear"](packed, scale, zero, group_size) is None
    x = torch.randn(2, k).to(torch.bfloat16)
    got = ops["int4_linear"](x, packed, scale, zero, None, group_size, None)
    assert torch.equal(got, native_ops.int4_linear(x, packed, scale, zero, None, group_size))
    assert not calls


def test_float32_and_empty_inputs_run_the_reference(torch_npu, monkeypatch):
    """The kernel takes float16/bfloat16 x and no empty tensor."""
    ops = ascend_int4_ops(torch_npu, A2)
    calls = _counted(monkeypatch, torch_npu)
    packed, scale, zero = _int4_weight(32, 64, 32)
    prepared = ops["prepare_int4_linear"](packed, scale, zero, 32)
    for x in (torch.randn(3, 64), torch.empty(0, 64, dtype=torch.bfloat16)):
        got = ops["int4_linear"](x, packed, scale, zero, None, 32, prepared)
        assert torch.equal(got, native_ops.int4_linear(x, packed, scale, zero, None, 32))
    assert not calls


@pytest.mark.parametrize(
    ("soc", "offered"),
    [(A2, True), ("Ascend910_9392", True), ("Ascend950PR_9579", True), ("Ascend310P3", False)],
    ids=["atlas-a2", "atlas-a3", "ascend-950", "atlas-300i-310p"],
)
def test_int4_is_offered_where_the_soc_runs_int4pack_weights_and_fp8_never(torch_npu, soc, offered):
    ops = ascend_int4_ops(torch_npu, soc)
    assert set(ops) == ({"int4_linear", "prepare_int4_linear", "int4_linear_takes"} if offered else set())


def test_the_platform_offers_int4_and_notes_its_limits_only_where_the_soc_runs_it(torch_npu):
    spec = importlib.util.spec_from_file_location("omnirun_npu_fake_lane", HERE / "fake_lane.py")
    lane = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lane)

    class Atlas300I(lane.FakeNpuPlatform):  # a 310P card: int8 weights only, fp16 only
        def _soc(self):
            return "Ascend310P3", False

    a2, card = lane.FakeNpuPlatform(), Atlas300I()
    assert "int4_linear" in a2.fused_ops() and INT4_NOTE in a2.notes()
    assert not {"int4_linear", "fp8_linear"} & set(card.fused_ops()) and INT4_NOTE not in card.notes()


@pytest.mark.parametrize("missing", ["npu_weight_quant_batchmatmul", "npu_convert_weight_to_int4pack"])
def test_a_torch_npu_without_the_kernels_offers_no_int4(torch_npu, monkeypatch, missing):
    monkeypatch.delattr(torch_npu, missing)
    assert ascend_int4_ops(torch_npu, A2) == {}


def test_the_fake_packs_as_the_documented_golden(torch_npu):
    """Value 8c + i in bits 4i..4i+3 of word c, two's complement nibbles: 1..7, -8 make 0x87654321."""
    values = torch.tensor([[1, 2, 3, 4, 5, 6, 7, -8], [0, 0, 0, 0, 0, 0, 0, -1]], dtype=torch.int32)
    words = torch_npu.npu_convert_weight_to_int4pack(values)
    assert words.tolist() == [[0x87654321 - 2**32], [0xF0000000 - 2**32]]
    assert torch.equal(fake._unpack_int4(words), values)
    with pytest.raises(fake.AtbCheckError, match=r"values in \[-8, 7\]"):
        torch_npu.npu_convert_weight_to_int4pack(values + 8)


def test_the_fake_kernel_checks_its_documented_constraints(torch_npu):
    k, n = 64, 16
    weight = torch_npu.npu_convert_weight_to_int4pack(torch.randint(-8, 8, (k, n), dtype=torch.int32))
    x = torch.randn(4, k).to(torch.bfloat16)
    scale = torch.rand(2, n).to(torch.bfloat16)
    run = torch_npu.npu_weight_quant_batchmatmul
    # A transposed int4pack weight: int32 [N, K / 8] seen as [K / 8, N].
    transposed = torch_npu.npu_convert_weight_to_int4pack(fake._unpack_int4(weight).t().contiguous()).t()
    expected = run(x, weight, scale, antiquant_group_size=32)
    assert torch.equal(run(x, transposed, scale, antiquant_group_size=32), expected)
    for call, message in [
        (lambda: run(x.float(), weight, scale.float(), antiquant_group_size=32), "x 2-D float16/bfloat16"),
        (lambda: run(x, weight, scale.half(), antiquant_group_size=32), "antiquant_scale in x's dtype"),
        (lambda: run(x, weight, scale, antiquant_group_size=16), "antiquant_group_size 0 or 32j"),
        (lambda: run(x, weight, scale), "antiquant_scale"),  # a per-group scale without its group size
        (lambda: run(x, weight, scale, scale.half(), antiquant_group_size=32), "antiquant_offset: antiquant_scale's"),
        (lambda: run(x, weight, scale, bias=torch.zeros(n).to(torch.bfloat16), antiquant_group_size=32), "bias"),
        (lambda: run(x[:, :32].contiguous(), weight, scale, antiquant_group_size=32), "x's K 32, weight's 64"),
        (lambda: run(x, weight, scale, quant_scale=scale, antiquant_group_size=32), "not faked: output quant"),
    ]:
        with pytest.raises(fake.AtbCheckError, match=message):
            call()


# --- a checkpoint on the npu platform (the npu-fake lane's fake, or a real Ascend) ---


def _dequantizing(platform):
    """The same platform without int4_linear: layers dequantize the checkpoint at load."""

    class Dequantizing(type(platform)):
        def device_fused_ops(self):
            ops = super().device_fused_ops()
            return {name: op for name, op in ops.items() if "int4" not in name}

    return Dequantizing()


@pytest.mark.device("npu")
@pytest.mark.parametrize(
    ("method", "group_size", "symmetric"), [("awq", 32, False), ("gptq", 64, True), ("pack-quantized", 32, True)]
)
def test_an_int4_checkpoint_keeps_its_layers_for_the_kernel_and_gives_hf_s_greedy_tokens(
    tmp_path, monkeypatch, method, group_size, symmetric
):
    """bf16, the kernel's dtype. Groups of 64 make the 64-input layers one group per row (per channel).
    pack-quantized: compressed-tensors' W4A16, as llm-compressor saves it."""
    if method == "pack-quantized":
        hf, _ = write_pack_quantized_checkpoint(tmp_path, "llama", 4, group_size, symmetric)
    else:
        hf, _ = write_int4_checkpoint(tmp_path, "llama", method, group_size, symmetric=symmetric)
    platform = get_platform("npu")
    assert {"int4_linear", "prepare_int4_linear"} <= set(platform.fused_ops())
    calls = _counted(monkeypatch, sys.modules["torch_npu"])
    kept = make_runner(platform, tmp_path, dtype="bfloat16")
    dequantized = make_runner(_dequantizing(platform), tmp_path, dtype="bfloat16")
    try:
        linears = [m for m in kept.model.modules() if isinstance(m, Linear) and m.int4 is not None]
        assert len(linears) == 8 and all(isinstance(m.prepared, AscendInt4Weight) for m in linears)
        assert "8 linear layers kept in int4" in kept.describe()["weights"]
        assert "dequantized" in dequantized.describe()["weights"]
        logits, reference = prefill_logits(kept).float(), prefill_logits(dequantized).float()
        assert calls  # the kept layers ran the kernel
        # The weights differ by the kernel's bf16 scale rounding alone; the logits move by a few bf16 steps.
        assert (logits - reference).abs().max() <= 2**-5 * reference.abs().max()
        tokens = greedy_generate(kept, PROMPTS, 8)
    finally:
        kept.close()
        dequantized.close()
    for prompt, ours in zip(PROMPTS, tokens, strict=True):
        if ours != hf_greedy(hf, prompt, 8):
            # HF runs the dequantized weights in float32: a bf16 near-tie may go the other way, but every token
            # must be HF's own choice up to bf16 resolution when HF is fed our sequence.
            gap, scale = greedy_gap(hf, prompt, ours)
            assert gap <= 2**-6 * scale, f"token off HF's argmax by {gap} (logits up to {scale})"


@pytest.mark.device("npu")
def test_a_weight_update_of_kept_int4_layers_reaches_the_npu_graphs(tmp_path):
    """The graphs captured the prepared int4 words and scales: an update goes into that memory (same structure),
    so a replayed step equals an eager one after it."""
    write_int4_checkpoint(tmp_path, "llama", "awq", 32)
    runner = make_runner(get_platform("npu"), tmp_path, dtype="bfloat16", max_running_requests=4)
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
    try:
        if runner.graph_runner is None:
            pytest.skip("the npu platform builds no graph runner here")
        layer = runner.model.model.layers[0].mlp.down_proj
        form = layer.prepared
        assert isinstance(form, AscendInt4Weight)
        _, before = replayed_and_eager(runner, prompts)
        name = "model.layers.0.mlp.down_proj.weight_scale"  # the kept layout's name (as read_weight gives it)
        runner.update_weights_from_tensor([(name, runner.get_weights_by_name(name) * 4)])
        replayed, eager = replayed_and_eager(runner, prompts)
        assert (eager.float() - before.float()).abs().max() > 0.1  # the update changed the step
        torch.testing.assert_close(replayed.float(), eager.float(), atol=3e-2, rtol=3e-2)  # as the conformance suite
        assert layer.prepared is form  # refreshed in place: no capture again
    finally:
        runner.close()
