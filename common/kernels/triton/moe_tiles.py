"""The Triton `fused_moe`'s launch choices for one device: when to take the decode path, and the tiles of each path
per batch bucket. One small JSON table per device name (`moe_tiles/<name>.json`, the name as the device reports it
with every character outside letters and digits made "_", as vLLM names its fused-MoE configs), read once when the
op table is built; a device without one gets DEFAULT, measured on an H100. `python bench/moe_op.py --sweep
--write-table` writes a device's table from its own sweep.

A table (every key required but the int4 and fp8 ones):

    {"decode_max_slots_per_expert": 1,
     "int4_decode_max_slots_per_expert": 4,
     "decode": [{"max_slots": 8, "gate_up": [4, 512, 4], "down": [4, 512, 4]}, ...],
     "fp8_decode": [{"max_slots": 8, "gate_up": [2, 1024, 4], "down": [4, 1024, 4]}, ...],
     "int4_decode": [{"max_slots": 8, "gate_up": [16, 1024, 4], "down": [4, 512, 4]}, ...],
     "grouped": [{"max_slots_per_expert": 32, "tile": [16, 64, 128, 4, 3]}, ...],
     "int4_grouped": [{"max_slots_per_expert": 4, "tile": [16, 128, 128, 4, 3]}, ...]}

`decode`: (BLOCK_N, BLOCK_K, warps) of the two decode kernels up to `max_slots` slots; `fp8_decode`: the same for
`fp8_fused_moe` (experts in fp8: half the bytes a row, so other tiles win), absent: fp8 takes `decode`'s; `grouped`:
(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) of the grouped GEMMs up to `max_slots_per_expert` slots per local expert
(plain and fp8 experts). int4 experts (`int4_fused_moe`) have kernels and launches of their own: `int4_decode` the
tiles of their decode kernels (int4_linear's GEMV products), `int4_decode_max_slots_per_expert` how far they take
the decode path, `int4_grouped` their grouped GEMMs' tiles; each absent: DEFAULT's. Buckets ascend; the last one
also serves anything larger (its bound says how far the sweep went). `python bench/moe_op.py --sweep --write-table
--fp8 --int4` writes the fp8 and int4 ones too.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from pathlib import Path
from typing import Any

TABLES = Path(__file__).with_name("moe_tiles")
OPTIONAL_DECODE = ("fp8_decode", "int4_decode")  # a table's decode buckets for quantized experts, each optional
OPTIONAL_BUCKETS = (*OPTIONAL_DECODE, "int4_grouped")


@dataclasses.dataclass(frozen=True)
class DecodeBucket:
    max_slots: int
    gate_up: tuple[int, int, int]  # BLOCK_N, BLOCK_K, warps
    down: tuple[int, int, int]


@dataclasses.dataclass(frozen=True)
class GroupedBucket:
    max_slots_per_expert: int
    tile: tuple[int, int, int, int, int]  # BLOCK_M, BLOCK_N, BLOCK_K, warps, stages


@dataclasses.dataclass(frozen=True)
class MoeTiles:
    # The decode path (a GEMV per slot, no sort) serves while slots <= this x the local experts.
    decode_max_slots_per_expert: float
    decode: tuple[DecodeBucket, ...]
    grouped: tuple[GroupedBucket, ...]
    fp8_decode: tuple[DecodeBucket, ...] = ()  # the decode kernels' tiles on fp8 experts; empty: `decode`'s
    int4_decode: tuple[DecodeBucket, ...] = ()  # the int4 decode kernels' tiles; empty: DEFAULT's
    # int4 experts take the decode path while slots <= this x the local experts; None: DEFAULT's
    int4_decode_max_slots_per_expert: float | None = None
    int4_grouped: tuple[GroupedBucket, ...] = ()  # the grouped GEMMs' tiles on int4 experts; empty: DEFAULT's
    source: str = dataclasses.field(default="default", compare=False)  # the table's file, or "default"

    def by_slot(self, slots: int, local_experts: int, weights: str = "plain") -> bool:
        """Whether `slots` (tokens x top_k) over this many local experts take the decode path, on experts whose
        `weights` are "plain", "fp8" or "int4" (int4's own bound: its decode kernels outrun its grouped GEMMs
        further)."""
        bound = self.decode_max_slots_per_expert
        if weights == "int4":
            own = self.int4_decode_max_slots_per_expert
            bound = DEFAULT.int4_decode_max_slots_per_expert if own is None else own
        return slots <= bound * local_experts

    def slot_tiles(self, slots: int, weights: str = "plain") -> DecodeBucket:
        """The decode kernels' tiles for `slots` on experts whose `weights` are "plain", "fp8" (the fp8 buckets where
        the table has any, else `decode`'s) or "int4" (int4's own kernels: the int4 buckets, else DEFAULT's)."""
        if weights == "int4":
            buckets = self.int4_decode or DEFAULT.int4_decode
        else:
            buckets = self.fp8_decode if weights == "fp8" and self.fp8_decode else self.decode
        return next((b for b in buckets if slots <= b.max_slots), buckets[-1])

    def grouped_tile(self, slots: int, local_experts: int, weights: str = "plain") -> tuple[int, int, int, int, int]:
        """The grouped GEMMs' tile for `slots` over this many local experts: int4 experts' own buckets (their
        unpacking wants wider tiles: 16 x 64 spilled registers), else DEFAULT's; others `grouped`'s."""
        buckets = (self.int4_grouped or DEFAULT.int4_grouped) if weights == "int4" else self.grouped
        per_expert = slots / local_experts
        return next((b for b in buckets if per_expert <= b.max_slots_per_expert), buckets[-1]).tile


# Measured on an H100 (bench/results/h100_moe_op_sweep_qwen3_30b_a3b.json, h100_moe_op_qwen3_30b_a3b_757ca9b.json):
# the decode path faster up to 16 Qwen3-30B-A3B tokens (128 slots over 128 experts); its tiles the fastest of seven
# each; the grouped tile the fastest of ten from 64 to 2,048 slots, 64 x 64 x 32 beyond.
# fp8 experts (bench/results/h100_moe_op_fp8_sweep_915fcc3.json, Qwen3-30B-A3B in 128 x 128 blocks, each kernel's
# tile varied with the other at `decode`'s): at 8 slots gate_up 2 x 1024 x 4 and down 4 x 1024 x 4, at 32 slots
# gate_up 2 x 1024 x 4 and down 8 x 256 x 4 were fastest. Together (h100_moe_op_fp8_tiles_dccb150.txt) 0.117 ms at
# 8 slots and 0.280 at 32, against 0.137 and 0.335 at `decode`'s tiles (h100_moe_op_fp8_c40a7db.txt).
# int4 experts (their own decode kernels; bench/results/h100_moe_op_int4_sweep_7bb460a.json, groups of 128, one
# kernel's tile varied with the other at 16 x 1,024 / 16 x 256): gate_up 16 x 1,024 and down 4 x 512 fastest at 8
# slots (0.132 and 0.108 ms against 0.141 at those tiles), gate_up 32 x 512 at 32 and 128 slots, down 16 x 512 at 32
# and 32 x 256 at 128. Their decode path outran their grouped GEMMs up to 64 tokens (512 slots, 4 an expert; 2.02
# against 3.80 ms), not at 256 (7.46 against 5.25; bench/results/h100_moe_op_int4_56d8910.txt). Their grouped tiles
# (bench/results/h100_moe_op_int4_grouped_tiles_0c7e8c8.txt, seven tiles): 16 x 128 x 128 at 4 slots an expert
# (2.50 ms against 3.80 for bf16's 16 x 64 x 128), 32 x 128 x 128 at 16 (2.81 against 5.14), 64 x 128 x 64 at 64
# (4.77 against 7.20 for bf16's 64 x 64 x 32); bf16's grouped GEMMs took 1.94, 2.15 and 3.72.
DEFAULT = MoeTiles(
    decode_max_slots_per_expert=1,
    decode=(DecodeBucket(8, (4, 512, 4), (4, 512, 4)), DecodeBucket(128, (8, 512, 4), (4, 256, 4))),
    grouped=(GroupedBucket(32, (16, 64, 128, 4, 3)), GroupedBucket(64, (64, 64, 32, 4, 3))),
    fp8_decode=(DecodeBucket(8, (2, 1024, 4), (4, 1024, 4)), DecodeBucket(128, (2, 1024, 4), (8, 256, 4))),
    int4_decode=(
        DecodeBucket(8, (16, 1024, 4), (4, 512, 4)),
        DecodeBucket(32, (32, 512, 4), (16, 512, 4)),
        DecodeBucket(128, (32, 512, 4), (32, 256, 4)),
    ),
    int4_decode_max_slots_per_expert=4,
    int4_grouped=(
        GroupedBucket(4, (16, 128, 128, 4, 3)),
        GroupedBucket(16, (32, 128, 128, 4, 3)),
        GroupedBucket(64, (64, 128, 64, 4, 3)),
    ),
)


def table_name(device_name: str) -> str:
    """The table file's name for a device: "NVIDIA H100 80GB HBM3" -> "NVIDIA_H100_80GB_HBM3.json"."""
    return re.sub(r"[^A-Za-z0-9]", "_", device_name) + ".json"


def from_json(data: dict[str, Any], source: str) -> MoeTiles:
    """A table's MoeTiles; ValueError naming the file and what is wrong."""
    try:
        tiles = MoeTiles(
            decode_max_slots_per_expert=float(data["decode_max_slots_per_expert"]),
            decode=_decode_buckets(data["decode"]),
            grouped=_grouped_buckets(data["grouped"]),
            fp8_decode=_decode_buckets(data["fp8_decode"]) if "fp8_decode" in data else (),
            int4_decode=_decode_buckets(data["int4_decode"]) if "int4_decode" in data else (),
            int4_decode_max_slots_per_expert=_bound(data.get("int4_decode_max_slots_per_expert")),
            int4_grouped=_grouped_buckets(data["int4_grouped"]) if "int4_grouped" in data else (),
            source=source,
        )
    except (KeyError, TypeError, ValueError) as error:
        problem = f"{source}: not a fused_moe tile table ({error!r})"
        raise ValueError(f"{problem}: see omnirun.kernels.triton.moe_tiles for the format") from None
    if not tiles.decode or not tiles.grouped:
        raise ValueError(f"{source}: a fused_moe tile table needs at least one decode and one grouped bucket")
    for key in OPTIONAL_BUCKETS:
        if key in data and not getattr(tiles, key):
            raise ValueError(f"{source}: {key}, where given, needs at least one bucket (leave it out for the default)")
    for key, buckets, bound in (
        ("decode", tiles.decode, "max_slots"),
        ("fp8_decode", tiles.fp8_decode, "max_slots"),
        ("int4_decode", tiles.int4_decode, "max_slots"),
        ("grouped", tiles.grouped, "max_slots_per_expert"),
        ("int4_grouped", tiles.int4_grouped, "max_slots_per_expert"),
    ):
        bounds = [getattr(bucket, bound) for bucket in buckets]
        if bounds != sorted(set(bounds)):
            raise ValueError(f"{source}: the {key} buckets' {bound} must ascend, not {bounds}")
    return tiles


def dumps(tiles: MoeTiles) -> str:
    """A table's file text: one bucket a line."""
    data = to_json(tiles)
    lines = [f'{{"decode_max_slots_per_expert": {json.dumps(data["decode_max_slots_per_expert"])},']
    if "int4_decode_max_slots_per_expert" in data:
        lines.append(f' "int4_decode_max_slots_per_expert": {json.dumps(data["int4_decode_max_slots_per_expert"])},')
    keys = [key for key in ("decode", *OPTIONAL_DECODE, "grouped", "int4_grouped") if key in data]
    for key in keys:
        buckets = ",\n  ".join(json.dumps(bucket) for bucket in data[key])
        lines.append(f' "{key}": [\n  {buckets}\n ]' + ("}" if key == keys[-1] else ","))
    return "\n".join(lines) + "\n"


def to_json(tiles: MoeTiles) -> dict[str, Any]:
    """A table as `from_json` reads it (the optional keys only where the table has them)."""
    data: dict[str, Any] = {
        "decode_max_slots_per_expert": tiles.decode_max_slots_per_expert,
        "decode": _decode_json(tiles.decode),
    }
    for key in OPTIONAL_DECODE:
        if getattr(tiles, key):
            data[key] = _decode_json(getattr(tiles, key))
    if tiles.int4_decode_max_slots_per_expert is not None:
        data["int4_decode_max_slots_per_expert"] = tiles.int4_decode_max_slots_per_expert
    data["grouped"] = _grouped_json(tiles.grouped)
    if tiles.int4_grouped:
        data["int4_grouped"] = _grouped_json(tiles.int4_grouped)
    return data


@functools.cache
def tiles_for(device_name: str | None, tables: Path = TABLES) -> MoeTiles:
    """The device's table if one is stored, else DEFAULT."""
    path = tables / table_name(device_name or "")
    if device_name and path.is_file():
        return from_json(json.loads(path.read_text()), str(path))
    return DEFAULT


def _grouped_buckets(buckets: Any) -> tuple[GroupedBucket, ...]:
    return tuple(GroupedBucket(int(b["max_slots_per_expert"]), _ints(b["tile"], 5)) for b in buckets)


def _grouped_json(buckets: tuple[GroupedBucket, ...]) -> list[dict[str, Any]]:
    return [{"max_slots_per_expert": b.max_slots_per_expert, "tile": list(b.tile)} for b in buckets]


def _decode_buckets(buckets: Any) -> tuple[DecodeBucket, ...]:
    return tuple(DecodeBucket(int(b["max_slots"]), _ints(b["gate_up"], 3), _ints(b["down"], 3)) for b in buckets)


def _decode_json(buckets: tuple[DecodeBucket, ...]) -> list[dict[str, Any]]:
    return [{"max_slots": b.max_slots, "gate_up": list(b.gate_up), "down": list(b.down)} for b in buckets]


def _bound(value: Any) -> float | None:
    if value is None:
        return None
    if float(value) < 0:
        raise ValueError(f"{value} is not a bound of slots per expert (0 or more)")
    return float(value)


def _ints(values: Any, count: int) -> tuple[int, ...]:
    numbers = tuple(int(v) for v in values)
    if len(numbers) != count or min(numbers) <= 0:
        raise ValueError(f"{list(values)} is not {count} positive integers")
    return numbers
