"""The Triton fused_moe's launch tables (omnirun.kernels.triton.moe_tiles): one per device name, read when the op
table is built, DEFAULT for a device without one, and a malformed table refused in one line naming its file."""

from __future__ import annotations

import json

import pytest

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
)

ACME = MoeTiles(
    decode_max_slots_per_expert=2,
    decode=(DecodeBucket(4, (2, 256, 2), (2, 128, 2)), DecodeBucket(64, (16, 256, 4), (8, 256, 4))),
    grouped=(GroupedBucket(8, (32, 32, 64, 4, 2)), GroupedBucket(16, (64, 128, 64, 8, 4))),
    int4_decode=(DecodeBucket(8, (16, 1024, 4), (4, 512, 4)), DecodeBucket(32, (32, 512, 4), (16, 512, 4))),
    int4_decode_max_slots_per_expert=4,
    int4_grouped=(GroupedBucket(4, (16, 128, 128, 4, 3)),),
)


def test_a_device_s_table_is_read_by_its_name(tmp_path):
    (tmp_path / table_name("Acme X1 (rev. 2)")).write_text(dumps(ACME))
    assert table_name("Acme X1 (rev. 2)") == "Acme_X1__rev__2_.json"
    read = tiles_for("Acme X1 (rev. 2)", tmp_path)
    assert read == ACME and read.source.endswith("Acme_X1__rev__2_.json")
    assert tiles_for("Acme X2", tmp_path) is DEFAULT and tiles_for(None, tmp_path) is DEFAULT


def test_every_stored_table_reads():
    tables = sorted(TABLES.glob("*.json"))
    assert "NVIDIA_H100_80GB_HBM3.json" in [path.name for path in tables]
    for path in tables:
        assert from_json(json.loads(path.read_text()), str(path)).decode


def test_buckets_pick_by_their_bounds_and_the_last_serves_more():
    assert ACME.by_slot(8, 4) and not ACME.by_slot(9, 4)
    assert [ACME.slot_tiles(slots).gate_up for slots in (1, 4, 5, 64, 1000)] == [(2, 256, 2)] * 2 + [(16, 256, 4)] * 3
    assert [ACME.grouped_tile(slots, 4)[0] for slots in (4, 32, 33, 64, 4000)] == [32, 32, 64, 64, 64]


@pytest.mark.parametrize(
    "change, complaint",
    [
        (lambda t: t.pop("grouped"), "KeyError"),
        (lambda t: t["decode"][0].update(gate_up=[4, 512]), "3 positive integers"),
        (lambda t: t["grouped"][0].update(tile=[16, 64, 0, 4, 3]), "5 positive integers"),
        (lambda t: t["decode"].reverse(), "must ascend"),
        (lambda t: t.update(grouped=[]), "at least one"),
        (lambda t: t.update(int4_decode_max_slots_per_expert=-1), "not a bound of slots per expert"),
        (lambda t: t["int4_decode"][0].update(down=[16, 0, 4]), "3 positive integers"),
        (lambda t: t.update(int4_decode=[]), "int4_decode, where given, needs at least one bucket"),
        (lambda t: t["int4_decode"].reverse(), "int4_decode buckets' max_slots must ascend"),
        (lambda t: t.update(int4_grouped=[]), "int4_grouped, where given, needs at least one bucket"),
        (lambda t: t["int4_grouped"][0].update(tile=[16, 64, 32]), "5 positive integers"),
    ],
)
def test_a_malformed_table_is_refused_naming_its_file(tmp_path, change, complaint):
    table = json.loads(dumps(ACME))
    change(table)
    path = tmp_path / table_name("Broken")
    path.write_text(json.dumps(table))
    with pytest.raises(ValueError, match=complaint) as error:
        tiles_for("Broken", tmp_path)
    assert str(path) in str(error.value) and "\n" not in str(error.value)


def test_the_op_table_binds_the_device_s_tiles():
    pytest.importorskip("triton", reason="triton is not installed (pip install 'omnirun[cuda]' or '[rocm]')")
    from omnirun.kernels.triton.ops import triton_fused_ops

    h100 = triton_fused_ops(device_name="NVIDIA H100 80GB HBM3")["fused_moe"].keywords["tiles"]
    assert h100.source == str(TABLES / "NVIDIA_H100_80GB_HBM3.json")
    assert triton_fused_ops(device_name="Acme X1")["fused_moe"].keywords["tiles"] is DEFAULT
