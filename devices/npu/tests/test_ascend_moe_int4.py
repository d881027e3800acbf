"""int4_fused_moe on npu_grouped_matmul's antiquant mode, over the fake torch_npu (which computes what the docs give
and refuses what they rule out): the op against the reference, expert parallelism, what takes the reference, where
it is offered, and an AWQ mixture loaded on the npu platform (npu-fake lane, or a real Ascend).

Tolerance: the kernel antiquantizes in x's dtype where the reference rounds the float32 experts once; both round
every projection's output, so the mixture agrees to the dtype's resolution (ascend's fused_moe tests' tolerance).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from omnirun.devices.npu.ascend_moe_int4 import AscendInt4Experts, ascend_int4_moe_ops
from omnirun.layers import native_ops, prepared
from omnirun.layers.linear import Linear
from omnirun.layers.moe import SparseMoE
from omnirun.registry import get_platform
from omnirun.testing import make_runner, replayed_and_eager
from quantized_checkpoints import _as_int32, prefill_logits, write_int4_checkpoint

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import fake_torch_npu as fake  # noqa: E402

A2 = "Ascend910B3"
TOKENS, EXPERTS, HIDDEN, INTER = 9, 6, 64, 32
TOLERANCE = {"atol": 3e-2, "rtol": 2e-2}


def _int4_grouped_matmuls(monkeypatch, torch_npu) -> list[int]:
    """Counts the grouped matmuls given an int4 weight (the op reads the attribute on each call)."""
    calls = []
    kernel = torch_npu.npu_grouped_matmul

    def counted(*args, **kwargs):
        calls.extend(1 for w in kwargs["weight"] if w.dtype == torch.int32)
        return kernel(*args, **kwargs)

    monkeypatch.setattr(torch_npu, "npu_grouped_matmul", counted)
    return calls


def _projection(rows: int, cols: int, group: int, symmetric: bool, gen: torch.Generator):
    """Our kept layout, stacked per expert: int32 [E, rows, cols / 8] (value 8c + i in bits 4i.. of word c), float32
    scales and uint8 zero points [E, rows, groups]."""
    q = torch.randint(0, 16, (EXPERTS, rows, cols), generator=gen)
    packed = _as_int32((q.view(EXPERTS, rows, cols // 8, 8) << torch.arange(0, 32, 4)).sum(-1))
    groups = 1 if group == -1 else -(-cols // group)
    scale = torch.rand(EXPERTS, rows, groups, generator=gen) * 0.02 + 1e-3
    zero = torch.full(scale.shape, 8, dtype=torch.uint8)
    if not symmetric:
        zero = torch.randint(0, 16, scale.shape, generator=gen).to(torch.uint8)
    return packed, scale, zero


def _inputs(dtype: torch.dtype, group: int, symmetric: bool = False, hidden: int = HIDDEN, seed: int = 0):
    """Expert 0 takes every token, expert 5 none, expert 3 exactly one (token 4's second choice)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(TOKENS, EXPERTS, generator=gen)
    logits[:, 5] = logits[:, 3] = -40.0
    logits[:, 0] = logits.max(dim=1).values + 0.5
    logits[4, 3] = logits[4, 0] - 0.25
    x = torch.randn(TOKENS, hidden, generator=gen).to(dtype)
    return (
        x,
        logits,
        (*_projection(2 * INTER, hidden, group, symmetric, gen), *_projection(hidden, INTER, group, symmetric, gen)),
    )


@pytest.mark.parametrize("renormalize", [True, False], ids=["renormalize", "raw-weights"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(
    ("group", "symmetric"), [(16, False), (32, True), (-1, False)], ids=["g16", "g32-sym", "per-channel"]
)
def test_int4_experts_run_the_grouped_matmul_and_match_the_reference(
    torch_npu, monkeypatch, dtype, group, symmetric, renormalize
):
    ops = ascend_int4_moe_ops(torch_npu, A2)
    calls = _int4_grouped_matmuls(monkeypatch, torch_npu)
    x, logits, experts = _inputs(dtype, group, symmetric)
    prepared = ops["prepare_int4_fused_moe"](*experts, group)
    assert isinstance(prepared, AscendInt4Experts)
    assert prepared.w13.weight.shape == (EXPERTS, HIDDEN, 2 * INTER // 8)  # [E, K, N / 8]: the kernel's layout
    got = ops["int4_fused_moe"](x, logits, *experts, 2, renormalize, 0, group, prepared)
    assert len(calls) == 2  # gate|up and down, each one grouped matmul on the int4 weights
    expected = native_ops.int4_fused_moe(x, logits, *experts, 2, renormalize, 0, group)
    torch.testing.assert_close(got, expected, **TOLERANCE)
    other = native_ops.int4_fused_moe(x, logits, *experts, 2, not renormalize, 0, group)
    assert not torch.allclose(got, other, **TOLERANCE)  # the tolerance tells the routings apart


def test_expert_parallel_slices_add_up_to_the_whole(torch_npu):
    ops = ascend_int4_moe_ops(torch_npu, A2)
    x, logits, experts = _inputs(torch.bfloat16, 16)
    total = torch.zeros(x.shape, dtype=torch.float32)
    for start in (0, 3):
        mine = [t[start : start + 3] for t in experts]
        prepared = ops["prepare_int4_fused_moe"](*mine, 16)
        part = ops["int4_fused_moe"](x, logits, *mine, 2, True, start, 16, prepared)
        torch.testing.assert_close(part, native_ops.int4_fused_moe(x, logits, *mine, 2, True, start, 16), **TOLERANCE)
        total += part.float()
    whole = native_ops.int4_fused_moe(x, logits, *experts, 2, True, 0, 16)
    torch.testing.assert_close(total, whole.float(), **TOLERANCE)


def test_what_the_kernel_does_not_take_runs_the_reference(torch_npu):
    ops = ascend_int4_moe_ops(torch_npu, A2)
    # groups of 48 over 64 inputs: a partial last group, which the grouped matmul's G | K rules out
    x, logits, experts = _inputs(torch.bfloat16, 48)
    assert ops["prepare_int4_fused_moe"](*experts, 48) is None
    got = ops["int4_fused_moe"](x, logits, *experts, 2, True, 0, 48, None)
    assert torch.equal(got, native_ops.int4_fused_moe(x, logits, *experts, 2, True, 0, 48))
    # float32 activations: the antiquant mode takes float16/bfloat16 only
    x, logits, experts = _inputs(torch.float32, 16)
    prepared = ops["prepare_int4_fused_moe"](*experts, 16)
    got = ops["int4_fused_moe"](x, logits, *experts, 2, True, 0, 16, prepared)
    assert torch.equal(got, native_ops.int4_fused_moe(x, logits, *experts, 2, True, 0, 16))


@pytest.mark.parametrize(("soc", "offered"), [(A2, True), ("Ascend910_9382", True), ("Ascend310P3", False)])
def test_int4_experts_are_offered_where_the_soc_runs_int4_grouped_matmuls(torch_npu, soc, offered):
    assert set(ascend_int4_moe_ops(torch_npu, soc)) == (
        {"int4_fused_moe", "prepare_int4_fused_moe"} if offered else set()
    )


@pytest.mark.parametrize("missing", ["npu_convert_weight_to_int4pack", "npu_moe_init_routing"])
def test_a_torch_npu_without_the_kernels_offers_no_int4_experts(torch_npu, monkeypatch, missing):
    monkeypatch.delattr(torch_npu, missing)
    assert ascend_int4_moe_ops(torch_npu, A2) == {}


def test_the_fake_grouped_matmul_checks_its_documented_antiquant_constraints(torch_npu):
    k, n = 64, 16
    words = torch_npu.npu_convert_weight_to_int4pack(torch.randint(-8, 8, (2 * k, n), dtype=torch.int32))
    weight = words.view(2, k, n // 8)
    x = torch.randn(4, k).to(torch.bfloat16)
    scale = torch.rand(2, 2, n).to(torch.bfloat16)
    counts = torch.tensor([1, 4])

    def run(x=x, scale=scale, offset=None, output_dtype=None):
        return torch_npu.npu_grouped_matmul(
            x=[x], weight=[weight], antiquant_scale=[scale], antiquant_offset=offset, split_item=2, group_type=0,
            group_list_type=0, group_list=counts, output_dtype=output_dtype,
        )[0]  # fmt: skip

    assert run().shape == (4, n)
    for call, message in [
        (lambda: run(x=x.float(), scale=scale.float()), "x float16/bfloat16"),
        (lambda: run(scale=scale.half()), "antiquant_scale in x's dtype"),
        (lambda: run(scale=torch.rand(2, 3, n).to(torch.bfloat16)), "G must divide K"),
        (lambda: run(offset=[scale.half()]), "antiquant_offset: antiquant_scale's"),
        (lambda: run(output_dtype=torch.float32), "y in x's dtype"),
    ]:
        with pytest.raises(fake.AtbCheckError, match=message):
            call()


# --- an AWQ mixture on the npu platform (the npu-fake lane's fake, or a real Ascend) ---


def _dequantizing(platform):
    """The same platform without int4_fused_moe: the experts are dequantized at load."""

    class Dequantizing(type(platform)):
        def device_fused_ops(self):
            return {name: op for name, op in super().device_fused_ops().items() if "int4_fused_moe" not in name}

    return Dequantizing()


@pytest.mark.device("npu")
def test_an_awq_mixture_keeps_its_experts_for_the_kernel_and_gives_the_dequantized_model_s_logits(
    tmp_path, monkeypatch
):
    write_int4_checkpoint(tmp_path, "qwen3_moe", "awq", 16)
    platform = get_platform("npu")
    assert {"int4_fused_moe", "prepare_int4_fused_moe"} <= set(platform.fused_ops())
    calls = _int4_grouped_matmuls(monkeypatch, sys.modules["torch_npu"])
    kept = make_runner(platform, tmp_path, dtype="bfloat16")
    dequantized = make_runner(_dequantizing(platform), tmp_path, dtype="bfloat16")
    try:
        moes = [m for m in kept.model.modules() if isinstance(m, SparseMoE)]
        assert moes and all(isinstance(m.prepared, AscendInt4Experts) for m in moes)
        assert "int4_fused_moe omnirun.devices.npu.ascend_moe_int4" in kept.describe()["experts"]
        assert "int4" not in dequantized.describe()["experts"]  # bf16 experts on the MoE kernels
        logits, reference = prefill_logits(kept).float(), prefill_logits(dequantized).float()
        assert calls  # the kept experts ran the kernel
        # The experts differ by the kernel's bf16 scale rounding alone; the logits move by a few bf16 steps.
        assert (logits - reference).abs().max() <= 2**-5 * reference.abs().max()
    finally:
        kept.close()
        dequantized.close()


@pytest.mark.device("npu")
def test_kept_int4_layers_and_experts_leave_their_loaded_words_in_host_memory(tmp_path, monkeypatch):
    """The prepared forms stand alone (reads_loaded_tensors False): the loaded words leave the device, and a prefill
    and a graph-replayed decode step give what they give with the words on the device. "meta" plays host memory
    here (the fake device is the host): a kernel that read it would fail. Groups of 32: the linear kernel's step."""
    write_int4_checkpoint(tmp_path, "qwen3_moe", "awq", 32)
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
    runs = {}
    for host in ("cpu", "meta"):
        monkeypatch.setattr(prepared, "HOST", torch.device(host))
        runner = make_runner(get_platform("npu"), tmp_path, dtype="bfloat16", max_running_requests=4)
        try:
            kept = [m for m in runner.model.modules() if isinstance(m, (Linear, SparseMoE)) and m.int4 is not None]
            words = ("weight_packed", "weight_scale", "weight_zero_point")
            loaded = [
                p for m in kept for p in (m.weights() if isinstance(m, SparseMoE) else map(m.get_parameter, words))
            ]
            assert any(isinstance(m, SparseMoE) for m in kept) and any(isinstance(m, Linear) for m in kept)
            assert {p.device.type for p in loaded} == {host}
            runs[host] = (prefill_logits(runner), *replayed_and_eager(runner, prompts))
        finally:
            runner.close()
    for on_device, on_host in zip(runs["cpu"], runs["meta"], strict=True):
        assert torch.equal(on_device, on_host)
