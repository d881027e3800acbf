"""The Triton `int4_fused_moe` op (experts kept in 4 bits, AWQ/GPTQ) against its torch reference
(omnirun.layers.native_ops.int4_fused_moe, which dequantizes the experts first), on both paths. Without a GPU the
kernels run in Triton's interpreter."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install 'omnirun[cuda]' or '[rocm]')")

from omnirun.kernels.triton import moe  # noqa: E402
from omnirun.kernels.triton.moe import int4_fused_moe  # noqa: E402
from omnirun.kernels.triton.moe_tiles import (  # noqa: E402
    DEFAULT,
    DecodeBucket,
    GroupedBucket,
    MoeTiles,
    dumps,
    from_json,
    table_name,
    tiles_for,
    to_json,
)
from omnirun.layers import native_ops  # noqa: E402
from omnirun.quantization.int4 import pack_int4_rows  # noqa: E402

pytestmark = pytest.mark.triton
DEVICE = torch.device("cpu")  # replaced per test by tests/kernels/conftest.py (the triton_device fixture)


# K steps of 32 on both paths (groups of 32: one a step; of 128 and -1: spanning steps; of 48: neither, the step
# drops to 16), or of 128 (holding several groups of 32, or of -1's over a shorter K). N tiles of 64: few programs
# for the interpreter.
def _steps(block_k: int) -> MoeTiles:
    decode = (DecodeBucket(1 << 30, (64, block_k, 4), (64, block_k, 4)),)
    grouped = (GroupedBucket(1 << 30, (16, 64, block_k, 4, 1)),)
    return MoeTiles(1, decode, grouped, int4_decode=decode, int4_grouped=grouped)


STEPS_32, STEPS_128 = _steps(32), _steps(128)


def _int4_experts(experts: int, rows: int, cols: int, group: int, seed: int):
    """Stacked 4-bit experts [n, rows, cols] as int4_fused_moe takes them: (packed int32 [n, rows, cols / 8], float32
    scales and uint8 zero points [n, rows, groups]), random q and zero points over 0..15, scales float16-representable
    and sized for weights of about 1 / sqrt(cols)."""
    gen = torch.Generator().manual_seed(seed)
    groups = 1 if group == -1 else -(-cols // group)
    q = torch.randint(0, 16, (experts, rows, cols), generator=gen)
    zero_point = torch.randint(0, 16, (experts, rows, groups), generator=gen).to(torch.uint8)
    scale = ((torch.rand(experts, rows, groups, generator=gen) + 0.5) / (8 * cols**0.5)).half().float()
    packed = torch.stack([pack_int4_rows(expert) for expert in q])
    return tuple(t.to(DEVICE) for t in (packed, scale, zero_point))


def _inputs(tokens: int, hidden: int, inter: int, experts: int, dtype: torch.dtype, group: int, seed: int = 0):
    """x, router logits, then w13's and w2's (packed, scale, zero point)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE, dtype)
    logits = torch.randn(tokens, experts, generator=gen)
    logits[:, 0] += 4.0  # expert 0 takes every token
    logits[:, -1] -= 40.0  # the last one none
    if tokens > 3:
        logits[3, 1] += 40.0
    w13 = _int4_experts(experts, 2 * inter, hidden, group, seed + 1)
    w2 = _int4_experts(experts, hidden, inter, group, seed + 2)
    return x, logits.to(DEVICE), w13, w2


@pytest.fixture(params=["by_slot", "grouped"])
def path(request, monkeypatch):
    """Each case through both paths: the decode path (a GEMV per slot) and the grouped GEMMs."""
    monkeypatch.setattr(MoeTiles, "by_slot", lambda self, slots, local, weights="plain": request.param == "by_slot")
    return request.param


def _tolerance(dtype: torch.dtype) -> dict[str, float]:
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}


@pytest.mark.parametrize(
    "tokens, dtype, group, hidden, inter, tiles",
    [
        (5, torch.float32, 32, 40, 48, STEPS_32),  # hidden 40: a partial last step and group
        (5, torch.bfloat16, 32, 136, 48, STEPS_128),
        (5, torch.bfloat16, 128, 136, 48, STEPS_32),  # two groups over hidden (the last of 8), one partial over inter
        (5, torch.bfloat16, -1, 40, 48, STEPS_32),
        (5, torch.float16, -1, 72, 48, STEPS_128),
        (5, torch.bfloat16, 48, 104, 48, STEPS_32),
        (5, torch.float32, 32, 64, 64, STEPS_32),  # whole steps: no mask along K
    ],
    ids=["fp32-g32", "bf16-g32-wide", "bf16-g128", "bf16-whole", "fp16-whole-wide", "bf16-g48", "fp32-even"],
)
def test_int4_experts_equal_the_reference(tokens, dtype, group, hidden, inter, tiles, path):
    x, logits, w13, w2 = _inputs(tokens, hidden, inter, experts=5, dtype=dtype, group=group)
    got = int4_fused_moe(x, logits, *w13, *w2, 2, True, 0, group, tiles=tiles)
    expected = native_ops.int4_fused_moe(x, logits, *w13, *w2, 2, True, 0, group)
    assert got.dtype == x.dtype and got.shape == x.shape
    torch.testing.assert_close(got.float(), expected.float(), **_tolerance(dtype))


@pytest.mark.parametrize("start", [0, 2])
def test_int4_experts_of_one_rank_under_expert_parallelism(start, path):
    """Experts start..start+1 of 4 on this rank: the kernel adds what the reference adds for them, and the two
    ranks' parts sum to the whole mixture."""
    x, logits, w13, w2 = _inputs(6, hidden=40, inter=32, experts=4, dtype=torch.float32, group=32)

    def rank(first: int) -> tuple[torch.Tensor, ...]:
        mine = slice(first, first + 2)
        return *(t[mine] for t in w13), *(t[mine] for t in w2)

    part = int4_fused_moe(x, logits, *rank(start), 2, False, start, 32, tiles=STEPS_32)
    expected = native_ops.int4_fused_moe(x, logits, *rank(start), 2, False, start, 32)
    torch.testing.assert_close(part, expected, atol=1e-5, rtol=1e-5)
    whole = part + int4_fused_moe(x, logits, *rank(2 - start), 2, False, 2 - start, 32, tiles=STEPS_32)
    expected = native_ops.int4_fused_moe(x, logits, *w13, *w2, 2, False, 0, 32)
    torch.testing.assert_close(whole, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype, group", [(torch.float64, 32), (torch.float32, 24)], ids=str)
def test_what_the_kernels_do_not_take_goes_to_the_reference(dtype, group, monkeypatch):
    """float64 activations, and groups that are not a multiple of 16, run the reference."""
    monkeypatch.setattr(moe, "_mixture", lambda *args: pytest.fail("the kernels ran"))
    x, logits, w13, w2 = _inputs(3, hidden=48, inter=24, experts=3, dtype=dtype, group=group)
    got = int4_fused_moe(x, logits, *w13, *w2, 2, True, 0, group)
    torch.testing.assert_close(got, native_ops.int4_fused_moe(x, logits, *w13, *w2, 2, True, 0, group))


def test_the_triton_op_table_offers_it_with_the_device_s_tiles():
    from omnirun.kernels.triton.ops import triton_fused_ops

    op = triton_fused_ops(device_name="NVIDIA H100 80GB HBM3")["int4_fused_moe"]
    assert op.func is int4_fused_moe and op.keywords == {"tiles": tiles_for("NVIDIA H100 80GB HBM3")}


def test_int4_tiles_round_trip_through_the_table_file_and_default_where_absent(tmp_path):
    """A table's `int4_decode` and `int4_grouped` buckets are read and written with it; a table without them gives
    int4 experts DEFAULT's int4 buckets, never `decode`'s or `grouped`'s (the plain experts' kernels' tiles)."""
    acme = dataclasses.replace(
        STEPS_32,
        int4_decode=(DecodeBucket(8, (8, 64, 2), (4, 32, 1)), STEPS_128.decode[0]),
        int4_grouped=(GroupedBucket(2, (16, 32, 64, 2, 1)), GroupedBucket(8, (32, 64, 32, 4, 2))),
    )
    (tmp_path / table_name("Acme X1")).write_text(dumps(acme))
    assert tiles_for("Acme X1", tmp_path) == acme
    assert [acme.slot_tiles(slots, "int4").gate_up for slots in (1, 8, 9)] == [(8, 64, 2), (8, 64, 2), (64, 128, 4)]
    assert [acme.grouped_tile(slots, 4, "int4")[0] for slots in (8, 9, 100)] == [16, 32, 32]
    assert acme.grouped_tile(8, 4) == STEPS_32.grouped[0].tile
    without = dataclasses.replace(acme, int4_decode=(), int4_grouped=())
    assert "int4_decode" not in to_json(without) and "int4_grouped" not in to_json(without)
    assert from_json(json.loads(dumps(without)), "x") == without
    assert without.slot_tiles(8, "int4") == DEFAULT.slot_tiles(8, "int4") != without.slot_tiles(8)
    assert without.grouped_tile(64, 4, "int4") == DEFAULT.grouped_tile(64, 4, "int4") != without.grouped_tile(64, 4)


def test_int4_experts_take_the_decode_path_as_far_as_their_own_bound(monkeypatch):
    """int4_decode_max_slots_per_expert (the int4 kernels' crossover) bounds int4 experts' decode path, bf16's bound
    the others'; read and written with the table, DEFAULT's where absent (0 is a bound: the grouped GEMMs always)."""
    table = dataclasses.replace(STEPS_32, decode_max_slots_per_expert=1, int4_decode_max_slots_per_expert=2)
    assert table.by_slot(8, 4, "int4") and not table.by_slot(9, 4, "int4")
    assert table.by_slot(4, 4) and not table.by_slot(5, 4) and not table.by_slot(5, 4, "fp8")
    assert from_json(json.loads(dumps(table)), "x") == table
    never = dataclasses.replace(table, int4_decode_max_slots_per_expert=0)
    assert not never.by_slot(1, 4, "int4") and from_json(json.loads(dumps(never)), "x") == never
    default = DEFAULT.int4_decode_max_slots_per_expert
    absent = dataclasses.replace(table, int4_decode_max_slots_per_expert=None)
    assert "int4_decode_max_slots_per_expert" not in to_json(absent)
    assert absent.by_slot(int(default * 4), 4, "int4") and not absent.by_slot(int(default * 4) + 1, 4, "int4")
    paths = []
    monkeypatch.setattr(moe, "_moe_by_slot", lambda *args: paths.append("by_slot") or args[0])
    x, logits, w13, w2 = _inputs(4, hidden=32, inter=16, experts=4, dtype=torch.float32, group=32)
    int4_fused_moe(x, logits, *w13, *w2, 2, True, 0, 32, tiles=table)  # 8 slots over 4 experts: 2 an expert
    assert paths == ["by_slot"]


def _recording(launched: list, name: str, keys: tuple[str, ...]):
    """Stands in for kernel `name` of moe (`kernel[grid](...)`): records each launch's `keys`, then launches it."""
    kernel = getattr(moe, name)

    class Launches:
        def __getitem__(self, grid):
            def launch(*args, **constexprs):
                launched.append((name, *(constexprs[key] for key in keys)))
                return kernel[grid](*args, **constexprs)

            return launch

    return Launches()


@pytest.mark.parametrize("group, block_k", [(32, 64), (48, 16), (-1, 64)])
def test_int4_experts_launch_their_decode_kernels_at_the_table_s_tiles(group, block_k, monkeypatch):
    """The decode path on int4 experts launches the int4 kernels (int4_linear's GEMV products) at the table's
    `int4_decode` tiles, each K step lowered to lie in one group or hold whole ones (groups of 48: 16), never the
    bf16 kernels; and equals the reference."""
    launched: list = []
    for name in ("_slot_gate_up_int4_kernel", "_token_down_int4_kernel", "_slot_gate_up_kernel", "_token_down_kernel"):
        monkeypatch.setattr(moe, name, _recording(launched, name, ("BLOCK_N", "BLOCK_K", "num_warps")))
    tiles = dataclasses.replace(STEPS_32, int4_decode=(DecodeBucket(1 << 30, (16, 64, 2), (32, 64, 1)),))
    x, logits, w13, w2 = _inputs(1, hidden=96, inter=48, experts=4, dtype=torch.float32, group=group)
    got = int4_fused_moe(x, logits, *w13, *w2, 2, True, 0, group, tiles=tiles)
    expected = native_ops.int4_fused_moe(x, logits, *w13, *w2, 2, True, 0, group)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert launched == [("_slot_gate_up_int4_kernel", 16, block_k, 2), ("_token_down_int4_kernel", 32, block_k, 1)]


@pytest.mark.parametrize("group, block_k", [(64, 64), (48, 16)])
def test_int4_experts_launch_the_grouped_gemms_at_their_own_tiles(group, block_k, monkeypatch):
    """The grouped path on int4 experts launches the grouped GEMMs at the table's `int4_grouped` tile for its slots
    per expert (never `grouped`'s), each K step lowered to lie in one group (groups of 48: 16); and equals the
    reference."""
    launched: list = []
    recording = _recording(launched, "_grouped_gemm_kernel", ("BLOCK_M", "BLOCK_N", "BLOCK_K"))
    monkeypatch.setattr(moe, "_grouped_gemm_kernel", recording)
    tiles = dataclasses.replace(
        STEPS_32,
        decode_max_slots_per_expert=0,
        int4_decode_max_slots_per_expert=0,
        int4_grouped=(GroupedBucket(1, (16, 32, 128, 4, 1)), GroupedBucket(4, (32, 64, 64, 4, 1))),
    )
    x, logits, w13, w2 = _inputs(6, hidden=128, inter=64, experts=4, dtype=torch.float32, group=group)
    got = int4_fused_moe(x, logits, *w13, *w2, 2, True, 0, group, tiles=tiles)  # 12 slots over 4 experts: 3 an expert
    expected = native_ops.int4_fused_moe(x, logits, *w13, *w2, 2, True, 0, group)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert launched == [("_grouped_gemm_kernel", 32, 64, block_k)] * 2
