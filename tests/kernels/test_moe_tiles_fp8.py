"""The fused-MoE launch table's fp8 decode tiles (`fp8_decode`, omnirun.kernels.triton.moe_tiles): read and written
with the table, optional (a table without them gives fp8 experts `decode`'s), refused in one line when malformed,
and launched by `fp8_fused_moe`'s decode path (bf16 experts keep `decode`'s). The kernels run in Triton's
interpreter without a GPU."""

from __future__ import annotations

import json

import pytest
import torch

from omnirun.kernels.triton.moe_tiles import (
    DEFAULT,
    TABLES,
    DecodeBucket,
    GroupedBucket,
    MoeTiles,
    dumps,
    from_json,
    table_name,
    tiles_for,
    to_json,
)
from omnirun.layers import native_ops

DEVICE = torch.device("cpu")  # replaced per test by tests/kernels/conftest.py (the triton_device fixture)

ACME = MoeTiles(
    decode_max_slots_per_expert=4,
    decode=(DecodeBucket(4, (8, 32, 4), (8, 32, 4)), DecodeBucket(64, (16, 256, 4), (8, 256, 4))),
    grouped=(GroupedBucket(8, (16, 16, 32, 4, 1)),),
    fp8_decode=(DecodeBucket(8, (2, 64, 1), (4, 64, 2)), DecodeBucket(32, (4, 128, 2), (2, 16, 1))),
)


def test_fp8_decode_round_trips_through_the_table_file(tmp_path):
    (tmp_path / table_name("Acme X1")).write_text(dumps(ACME))
    assert tiles_for("Acme X1", tmp_path) == ACME
    without = MoeTiles(ACME.decode_max_slots_per_expert, ACME.decode, ACME.grouped)
    assert "fp8_decode" not in to_json(without) and from_json(json.loads(dumps(without)), "x") == without


def test_a_table_without_fp8_decode_gives_fp8_the_decode_buckets():
    h100 = json.loads((TABLES / "NVIDIA_H100_80GB_HBM3.json").read_text())
    del h100["fp8_decode"]
    old = from_json(h100, "old.json")
    assert old.fp8_decode == ()
    assert all(old.slot_tiles(slots, "fp8") == old.slot_tiles(slots) for slots in (1, 8, 9, 128, 1000))
    fp8_gate_up = [ACME.slot_tiles(slots, "fp8").gate_up for slots in (1, 8, 9, 1000)]
    assert fp8_gate_up == [(2, 64, 1), (2, 64, 1), (4, 128, 2), (4, 128, 2)]
    assert ACME.slot_tiles(8).gate_up == (16, 256, 4)  # bf16 experts: `decode`'s


def test_the_h100_table_and_default_hold_the_swept_fp8_tiles():
    """bench/results/h100_moe_op_fp8_sweep_915fcc3.json: gate_up 2 x 1024 at 8 and 32 slots, down 4 x 1024 then
    8 x 256; bf16 experts keep the decode tiles."""
    stored = tiles_for("NVIDIA H100 80GB HBM3")
    assert stored == DEFAULT
    assert DEFAULT.slot_tiles(8, "fp8") == DecodeBucket(8, (2, 1024, 4), (4, 1024, 4))
    assert DEFAULT.slot_tiles(32, "fp8") == DecodeBucket(128, (2, 1024, 4), (8, 256, 4))
    assert DEFAULT.slot_tiles(8) == DecodeBucket(8, (4, 512, 4), (4, 512, 4))


@pytest.mark.parametrize(
    "change, complaint",
    [
        (lambda t: t["fp8_decode"][0].update(gate_up=[2, 1024]), "3 positive integers"),
        (lambda t: t["fp8_decode"][1].pop("down"), "KeyError"),
        (lambda t: t["fp8_decode"].reverse(), "fp8_decode buckets' max_slots must ascend"),
        (lambda t: t.update(fp8_decode=[]), "at least one bucket"),
        (lambda t: t.update(fp8_decode={"max_slots": 8}), "not a fused_moe tile table"),
    ],
)
def test_a_malformed_fp8_decode_is_refused_in_one_line(tmp_path, change, complaint):
    table = json.loads(dumps(ACME))
    change(table)
    path = tmp_path / table_name("Broken")
    path.write_text(json.dumps(table))
    with pytest.raises(ValueError, match=complaint) as error:
        tiles_for("Broken", tmp_path)
    assert str(path) in str(error.value) and "\n" not in str(error.value)


def _inputs(tokens: int, hidden: int, inter: int, experts: int, block: tuple[int, int]):
    """x, router logits, and fp8 experts with block scales (values in float8_e4m3fn, one float32 scale a block)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=gen)
    logits = torch.randn(tokens, experts, generator=gen)
    fp8 = []
    for rows, cols in ((2 * inter, hidden), (hidden, inter)):
        scale = (torch.rand(experts, -(-rows // block[0]), -(-cols // block[1]), generator=gen) + 0.5) / (8 * cols**0.5)
        values = (torch.randn(experts, rows, cols, generator=gen) * 8).clamp(-448, 448).to(torch.float8_e4m3fn)
        fp8 += [values.to(DEVICE), scale.to(DEVICE)]
    return (x.to(DEVICE), logits.to(DEVICE), *fp8)


class _Launches:
    """Stands in for a decode kernel (`kernel[grid](...)`): records each launch's tile, then launches it."""

    def __init__(self, kernel, name: str, log: list):
        self.kernel, self.name, self.log = kernel, name, log

    def __getitem__(self, grid):
        def launch(*args, **constexprs):
            self.log.append((self.name, constexprs["BLOCK_N"], constexprs["BLOCK_K"], constexprs["num_warps"]))
            return self.kernel[grid](*args, **constexprs)

        return launch


@pytest.mark.triton
def test_fp8_experts_launch_the_fp8_decode_tiles(monkeypatch):
    """DEFAULT's fp8 buckets differ from its decode ones: fp8 experts in an fp8 checkpoint's 128 x 128 blocks launch
    them (gate_up 2 x 1024 and down 4 x 1024 at 2 slots: rows fewer than a scale block's, a K step over eight scale
    columns, the second partial (hidden 136) and the rest past K), bf16 experts the decode ones (4 x 512), and both
    equal the reference. Shapes small: the interpreter takes ~25 ms a program."""
    pytest.importorskip("triton", reason="triton is not installed (pip install 'omnirun[cuda]' or '[rocm]')")
    from omnirun.kernels.triton import moe

    log: list = []
    for name in ("_slot_gate_up_kernel", "_token_down_kernel"):
        monkeypatch.setattr(moe, name, _Launches(getattr(moe, name), name, log))
    x, logits, q13, s13, q2, s2 = _inputs(1, hidden=136, inter=8, experts=4, block=(128, 128))  # the decode path
    got = moe.fp8_fused_moe(x, logits, q13, s13, q2, s2, 2, True, 0, (128, 128), tiles=DEFAULT)
    expected = native_ops.fp8_fused_moe(x, logits, q13, s13, q2, s2, 2, True, 0, (128, 128))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert log == [("_slot_gate_up_kernel", 2, 1024, 4), ("_token_down_kernel", 4, 1024, 4)]

    log.clear()
    x, logits, q13, _, q2, _ = _inputs(1, hidden=40, inter=16, experts=4, block=(16, 16))
    w13, w2 = q13.float() / 64, q2.float() / 64  # plain float32 experts: bf16's path
    got = moe.fused_moe(x, logits, w13, w2, 2, True, tiles=DEFAULT)
    torch.testing.assert_close(got, native_ops.fused_moe(x, logits, w13, w2, 2, True), atol=1e-5, rtol=1e-5)
    assert log == [("_slot_gate_up_kernel", 4, 512, 4), ("_token_down_kernel", 4, 512, 4)]
