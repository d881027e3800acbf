"""The Triton `fused_moe` op against its torch reference (omnirun.layers.native_ops.fused_moe), and the slot sort
it rests on. Without a GPU the kernel runs in Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install 'omnirun[cuda]' or '[rocm]')")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from omnirun.kernels.triton.moe import _fnuz, fp8_fused_moe, fused_moe, route, sort_slots  # noqa: E402
from omnirun.kernels.triton.moe_tiles import DecodeBucket, GroupedBucket, MoeTiles  # noqa: E402
from omnirun.layers import native_ops  # noqa: E402

pytestmark = pytest.mark.triton
DEVICE = torch.device("cpu")  # replaced per test by tests/kernels/conftest.py (the triton_device fixture)


def _inputs(tokens: int, hidden: int, inter: int, experts: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) / inter**0.5
    logits = torch.randn(tokens, experts, generator=gen)
    logits[:, 0] += 4.0  # expert 0 takes every token (and leaves the other choice a weight that renormalising moves)
    logits[:, -1] -= 40.0  # the last one none
    if tokens > 3:
        logits[3, 1] += 40.0  # expert 1 at least token 3
    assert (native_ops.route(logits, 2, False)[1] == 0).any(dim=-1).all()
    return tuple(t.to(DEVICE, dtype) for t in (x, logits, w13, w2))


@pytest.fixture(params=["by_slot", "grouped"])
def path(request, monkeypatch):
    """Each case through both paths: the decode path (a GEMV per slot) and the grouped GEMMs."""
    monkeypatch.setattr(MoeTiles, "by_slot", lambda self, slots, local, weights="plain": request.param == "by_slot")
    return request.param


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize(
    "tokens, dtype", [(1, torch.float32), (5, torch.float32), (70, torch.float32), (9, torch.bfloat16)], ids=str
)
def test_kernel_equals_the_reference(tokens, dtype, renormalize, path):
    if path == "by_slot" and tokens == 70:  # 140 slots over 6 experts: several blocks an expert, a grouped case
        pytest.skip("the decode path never takes 70 tokens over 6 experts (at most as many slots as experts)")
    x, logits, w13, w2 = _inputs(tokens, hidden=32, inter=48, experts=6, dtype=dtype)
    got = fused_moe(x, logits.float(), w13, w2, 2, renormalize)
    expected = native_ops.fused_moe(x, logits.float(), w13, w2, 2, renormalize)
    assert got.dtype == x.dtype and got.shape == x.shape
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(got.float(), expected.float(), **tolerance)


@pytest.mark.parametrize("start", [0, 3])
def test_one_rank_s_experts_under_expert_parallelism(start, path):
    """Experts start..start+2 of 6 on this rank: the kernel adds what the reference adds for them, and the two
    ranks' parts sum to the whole mixture."""
    x, logits, w13, w2 = _inputs(11, hidden=32, inter=16, experts=6, dtype=torch.float32)
    part = fused_moe(x, logits, w13[start : start + 3], w2[start : start + 3], 2, True, start)
    expected = native_ops.fused_moe(x, logits, w13[start : start + 3], w2[start : start + 3], 2, True, start)
    torch.testing.assert_close(part, expected, atol=1e-5, rtol=1e-5)
    other = 3 - start
    whole = part + fused_moe(x, logits, w13[other : other + 3], w2[other : other + 3], 2, True, other)
    torch.testing.assert_close(whole, native_ops.fused_moe(x, logits, w13, w2, 2, True), atol=1e-5, rtol=1e-5)


def _fp8_experts(weight: torch.Tensor, block: tuple[int, int] | None, seed: int):
    """Stacked experts [n, N, K] as an fp8 checkpoint holds them: float8_e4m3fn values and float32 scales drawn
    between 0.5x and 1.5x of a weight-sized step, per row ([n, N]) or per block ([n, ceil(N / r), ceil(K / c)])."""
    n, rows, cols = weight.shape
    gen = torch.Generator().manual_seed(seed)
    shape = (n, rows) if block is None else (n, -(-rows // block[0]), -(-cols // block[1]))
    scale = (torch.rand(shape, generator=gen) + 0.5) * weight.float().abs().mean().cpu() / 8
    values = (torch.randn(n, rows, cols, generator=gen) * 8).clamp(-448, 448).to(torch.float8_e4m3fn)
    return values.to(weight.device), scale.to(weight.device)


# K tiles of 32 on both paths: blocks of 8 and 16 columns are several scales a step, blocks of 64 span two steps.
SMALL_TILES = MoeTiles(
    1, (DecodeBucket(1 << 30, (8, 32, 4), (8, 32, 4)),), (GroupedBucket(1 << 30, (16, 16, 32, 4, 1)),)
)


@pytest.mark.parametrize(
    "tokens, dtype, block",
    [(5, torch.float32, block) for block in (None, (16, 16), (16, 64), (32, 8))]
    + [(9, torch.bfloat16, None), (9, torch.bfloat16, (16, 64))],
    ids=str,
)
def test_fp8_experts_equal_the_reference(tokens, dtype, block, path):
    """The kernels on fp8 experts with per-row or block scales (a block's columns fewer than and more than the K
    tile's; rows more than the N tile's) equal the reference, which dequantizes them first; the last blocks of each
    projection partial (inter 48 and hidden 40 are not whole 32 x 64 blocks)."""
    x, logits, w13, w2 = _inputs(tokens, hidden=40, inter=48, experts=5, dtype=dtype)
    (q13, s13), (q2, s2) = _fp8_experts(w13, block, 1), _fp8_experts(w2, block, 2)
    got = fp8_fused_moe(x, logits.float(), q13, s13, q2, s2, 2, True, 0, block, tiles=SMALL_TILES)
    expected = native_ops.fp8_fused_moe(x, logits.float(), q13, s13, q2, s2, 2, True, 0, block)
    assert got.dtype == x.dtype and got.shape == x.shape
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(got.float(), expected.float(), **tolerance)
    assert not torch.allclose(expected, native_ops.fused_moe(x, logits.float(), q13.to(dtype), q2.to(dtype), 2, True))


@pytest.mark.parametrize("block", [None, (16, 16), (16, 64)], ids=str)
def test_fp8_experts_read_as_fnuz_give_the_same_mixture(block, path):
    """`fnuz` (the ROCm platform's fp8_fused_moe on an MI300): the kernels read the e4m3fn bits as e4m3fnuz and double
    the scales, which gives the same float32 mixture bit for bit, e4m3fn's negative zeros (0x80) included.
    fp8e4b8 exists on AMD GPUs (and in the interpreter), not on NVIDIA's."""
    if DEVICE.type == "cuda" and torch.version.hip is None:
        pytest.skip("e4m3fnuz (fp8e4b8) is an AMD encoding: NVIDIA GPUs do not convert it")
    x, logits, w13, w2 = _inputs(5, hidden=40, inter=48, experts=5, dtype=torch.float32)
    (q13, s13), (q2, s2) = _fp8_experts(w13, block, 5), _fp8_experts(w2, block, 6)
    q13.view(torch.uint8)[:, :3, :5] = 0x80  # e4m3fn's -0.0
    fnuz = fp8_fused_moe(x, logits, q13, s13, q2, s2, 2, True, 0, block, tiles=SMALL_TILES, fnuz=True)
    ocp = fp8_fused_moe(x, logits, q13, s13, q2, s2, 2, True, 0, block, tiles=SMALL_TILES)
    assert torch.equal(fnuz, ocp) and not fnuz.isnan().any()
    expected = native_ops.fp8_fused_moe(x, logits, q13, s13, q2, s2, 2, True, 0, block)
    torch.testing.assert_close(fnuz, expected, atol=1e-5, rtol=1e-5)


@triton.jit
def _fnuz_bits(x_ptr, y_ptr):
    offs = tl.arange(0, 256)
    tl.store(y_ptr + offs, _fnuz(tl.load(x_ptr + offs)).to(tl.uint8, bitcast=True))


def test_fnuz_turns_e4m3fn_negative_zero_into_zero_and_keeps_every_other_pattern():
    """_fnuz's bits: 0x80 (e4m3fn's -0.0, e4m3fnuz's NaN on the GPU; the interpreter reads it as -0, so the mixture
    above cannot tell) becomes 0x00; the other 255 patterns pass unchanged."""
    if DEVICE.type == "cuda" and torch.version.hip is None:
        pytest.skip("e4m3fnuz (fp8e4b8) is an AMD encoding: NVIDIA GPUs do not convert it")
    patterns = torch.arange(256, dtype=torch.int32).to(torch.uint8).to(DEVICE)
    out = torch.empty_like(patterns)
    _fnuz_bits[(1,)](patterns, out)
    expected = patterns.clone()
    expected[0x80] = 0
    assert torch.equal(out, expected)


@pytest.mark.parametrize("start", [0, 2])
def test_fp8_experts_of_one_rank_under_expert_parallelism(start, path):
    x, logits, w13, w2 = _inputs(11, hidden=32, inter=32, experts=4, dtype=torch.float32)
    (q13, s13), (q2, s2) = _fp8_experts(w13, (16, 16), 3), _fp8_experts(w2, (16, 16), 4)
    mine = slice(start, start + 2)
    got = fp8_fused_moe(x, logits, q13[mine], s13[mine], q2[mine], s2[mine], 2, False, start, (16, 16), SMALL_TILES)
    expected = native_ops.fp8_fused_moe(x, logits, q13[mine], s13[mine], q2[mine], s2[mine], 2, False, start, (16, 16))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("renormalize", [True, False])
def test_routing_equals_the_reference_and_the_first_of_equal_experts_wins(renormalize):
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(33, 160, generator=gen)  # 160 experts: a block of 256 with 96 masked off
    logits[0, :] = 0.0  # all equal: experts 0..7
    logits[1, [3, 9, 100, 150]] = 9.0  # four equal leaders, then the rest by value
    logits = logits.to(DEVICE)
    weights, ids = route(logits, 8, renormalize)
    expected_weights, expected_ids = native_ops.route(logits, 8, renormalize)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert ids[0].tolist() == list(range(8)) and ids[1, :4].tolist() == [3, 9, 100, 150]
    assert ids[2:].tolist() == expected_ids[2:].tolist()
    torch.testing.assert_close(weights, expected_weights, atol=1e-6, rtol=1e-5)


def test_slots_are_sorted_by_expert_in_whole_blocks():
    experts = torch.tensor([[2, 0], [0, 3], [2, 0]], device=DEVICE)  # slots 0..5; expert 1 gets none
    sorted_slots, block_experts, total = sort_slots(experts, num_experts=4, block_m=4)
    pad = experts.numel()
    # expert 0: slots 1, 2, 5 (one block), expert 2: slots 0, 4 (one block), expert 3: slot 3 (one block)
    assert total.tolist() == [12]
    assert sorted_slots[:12].tolist() == [1, 2, 5, pad, 0, 4, pad, pad, 3, pad, pad, pad]
    assert block_experts[:3].tolist() == [0, 2, 3]
    assert (sorted_slots[12:] == pad).all()  # blocks past the total are padding, and the kernel skips them


def test_another_rank_s_slots_sort_past_the_total():
    """Expert id 4 of 4 local experts marks a slot another rank computes: no block of this rank's holds it."""
    experts = torch.tensor([[2, 0], [4, 3], [2, 4]], device=DEVICE)
    sorted_slots, block_experts, total = sort_slots(experts, num_experts=4, block_m=4)
    pad = experts.numel()
    assert total.tolist() == [12]
    assert sorted_slots[:12].tolist() == [1, pad, pad, pad, 0, 4, pad, pad, 3, pad, pad, pad]
    assert sorted(sorted_slots[12:16].tolist()) == [2, 5, pad, pad]  # past the total: the kernels never read it


def test_a_mixture_of_experts_model_through_the_kernel_equals_hf(tmp_path):
    """Qwen2-MoE (shared expert, a dense layer) on the CPU platform with the Triton kernel as its `fused_moe`, in
    Triton's interpreter (on a GPU, common/conformance/test_moe_vs_hf.py runs the models through the kernel)."""
    if DEVICE.type != "cpu":
        pytest.skip("the CPU platform cannot launch compiled kernels; the conformance suite covers the GPU")
    from omnirun.devices.cpu.platform import CpuPlatform
    from omnirun.testing import greedy_generate, hf_greedy, make_runner, tiny_hf_model

    class CpuWithTritonMoe(CpuPlatform):
        def device_fused_ops(self):
            return {**super().device_fused_ops(), "fused_moe": fused_moe}

    hf = tiny_hf_model("qwen2_moe")
    hf.save_pretrained(tmp_path)
    runner = make_runner(CpuWithTritonMoe(), tmp_path)
    try:
        assert runner.ops.fused_moe is fused_moe
        prompt = [(7 * i + 3) % 256 for i in range(19)]
        assert greedy_generate(runner, [prompt], 6) == [hf_greedy(hf, prompt, 6)]
    finally:
        runner.close()


def test_the_kernel_launches_its_table_s_tiles(monkeypatch):
    """A device's table (omnirun.kernels.triton.moe_tiles) decides the path and the grouped GEMMs' tile."""
    from omnirun.kernels.triton import moe
    from omnirun.kernels.triton.moe_tiles import DecodeBucket, GroupedBucket

    launched = []
    grouped_gemm = moe._grouped_gemm
    monkeypatch.setattr(moe, "_grouped_gemm", lambda *args, **kw: launched.append(args[9]) or grouped_gemm(*args, **kw))
    x, logits, w13, w2 = _inputs(9, hidden=32, inter=48, experts=6, dtype=torch.float32)
    expected = native_ops.fused_moe(x, logits, w13, w2, 2, True)
    for decode_up_to, tile in ((0, (32, 32, 16, 4, 2)), (0, (16, 64, 32, 2, 3)), (3, None)):
        tiles = MoeTiles(
            decode_up_to, (DecodeBucket(64, (4, 32, 2), (8, 16, 2)),), (GroupedBucket(4, tile or (16,) * 5),)
        )
        launched.clear()
        torch.testing.assert_close(fused_moe(x, logits, w13, w2, 2, True, tiles=tiles), expected, atol=1e-5, rtol=1e-5)
        assert launched == ([tile, tile] if tile else [])  # 18 slots over 6 experts: decode while 3 x 6 >= 18
