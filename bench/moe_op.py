"""The Triton `fused_moe` op alone, no model, at a preset's mixture-of-experts shape: each path (`by_slot`, the
decode path's GEMV per slot; `grouped`, the sorted grouped GEMMs) per batch size, against two bounds measured in the
same run: the floor (the bytes of the experts the batch reaches, ÷ the copy bandwidth) and a matmul-only
calibration in plain torch (each reached expert's two GEMMs on its routed tokens, gathered beforehand, in a graph).
Every timing replays a device graph over `--layers` copies of the weights (more than the L2 cache holds), as a
decode step runs its layers. `--sweep` also times each path's candidate tiles and prints the fastest per batch;
`--write-table` then writes the device's launch table (omnirun.kernels.triton.moe_tiles) from the sweep: the
faster path per batch, and each path's fastest tiles, one bucket per swept batch size.

`--fp8` also times `fp8_fused_moe` on the same experts quantized to fp8 in 128 x 128 blocks (as Qwen3-30B-A3B-FP8
ships them), and `--int4` `int4_fused_moe` on them quantized to 4 bits in groups of 128 with zero points (as AWQ
checkpoints hold them), each path at the table's tiles (the decode path at the format's tiles, `fp8_decode` /
`int4_decode`), against the floor of the quantized bytes; with `--sweep` the format's decode tiles are swept too,
and `--write-table` writes the fastest into the table (a format not timed keeps the current table's tiles); int4's
grouped tiles and its decode/grouped crossover are swept and written too.

    python bench/moe_op.py --device cuda --preset qwen3-30b-a3b --batch-sizes 1 4 16 64 256 \
        --json bench/results/h100_moe_op.json [--sweep --write-table] [--fp8] [--int4]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from graph_timing import graph_ms  # bench/: beside this script

from omnirun.bandwidth import measure_bandwidth
from omnirun.kernels.triton import moe
from omnirun.kernels.triton.moe_tiles import TABLES, DecodeBucket, GroupedBucket, MoeTiles, dumps, table_name, tiles_for
from omnirun.layers import native_ops
from omnirun.loader.presets import preset_config
from omnirun.models.architecture import decoder_shape
from omnirun.quantization.int4 import pack_int4_rows
from omnirun.registry import select_platform

SLOT_TILES = {
    "gate_up": [(2, 1024, 4), (4, 256, 4), (4, 512, 4), (8, 256, 4), (8, 512, 4), (8, 512, 8), (16, 256, 4)],
    "down": [(2, 256, 4), (4, 128, 4), (4, 256, 4), (4, 512, 4), (8, 128, 4), (8, 256, 4), (16, 256, 4)],
}
# int4 experts' grouped GEMMs also try these: their unpacking wants wider tiles (at 16 x 64 the compiler spills)
INT4_GROUPED_TILES = [(16, 128, 128, 4, 3), (32, 128, 128, 4, 3), (32, 128, 64, 4, 3), (64, 128, 64, 4, 3)]
GROUPED_TILES = [
    (16, 64, 32, 4, 3),
    (16, 64, 64, 4, 4),
    (16, 128, 64, 4, 3),
    (16, 64, 128, 4, 3),
    (32, 64, 64, 4, 4),
    (64, 64, 32, 4, 3),
    (64, 64, 64, 4, 4),
    (64, 128, 64, 4, 3),
    (64, 128, 64, 8, 4),
    (128, 128, 64, 8, 3),
]


def candidates(path: str, decode: DecodeBucket):
    """(kernel, tiles) of each candidate: the decode path's kernels varied one at a time, the other at its
    table's tile; the grouped GEMMs' tile."""
    if path == "grouped":
        return [("tile", tile) for tile in GROUPED_TILES]
    fixed = {"gate_up": decode.gate_up, "down": decode.down}
    return [(kernel, {**fixed, kernel: tile}) for kernel, tiles in SLOT_TILES.items() for tile in tiles]


def swept_table(rows: list[dict], experts: int, top_k: int) -> MoeTiles:
    """The launch table a sweep measured: the decode path up to the largest batch where it was faster (bf16's
    crossover; int4's own where the rows timed int4), and each swept batch's fastest tiles as a bucket bounded by its
    slots (the fp8 and int4 decode tiles where the rows swept them)."""

    def fastest(row, prefix):
        times = {k: v for k, v in row.items() if k.startswith(prefix)}
        return tuple(int(n) for n in min(times, key=times.get).removeprefix(prefix).removesuffix("_ms").split("x"))

    decode_wins = [row["batch"] * top_k for row in rows if row["by_slot_ms"] < row["grouped_ms"]]
    int4_rows = [row for row in rows if "int4_by_slot_ms" in row]
    int4_wins = [row["batch"] * top_k for row in int4_rows if row["int4_by_slot_ms"] < row["int4_grouped_ms"]]
    decode, fp8_decode, int4_decode = (
        tuple(
            DecodeBucket(row["batch"] * top_k, fastest(row, f"{prefix}gate_up_"), fastest(row, f"{prefix}down_"))
            for row in rows
            if any(k.startswith(f"{prefix}gate_up_") for k in row)
        )
        for prefix in ("by_slot_", "fp8_by_slot_", "int4_by_slot_")
    )
    grouped, int4_grouped = (
        tuple(
            GroupedBucket(-(-row["batch"] * top_k // experts), fastest(row, prefix))
            for row in rows
            if any(k.startswith(prefix) for k in row)
        )
        for prefix in ("grouped_tile_", "int4_grouped_tile_")
    )
    return MoeTiles(
        max(decode_wins, default=0) / experts,
        _distinct(decode),
        _distinct(grouped),
        fp8_decode=_distinct(fp8_decode),
        int4_decode=_distinct(int4_decode),
        int4_decode_max_slots_per_expert=max(int4_wins, default=0) / experts if int4_rows else None,
        int4_grouped=_distinct(int4_grouped),
    )


def _distinct(buckets):
    """Buckets whose bounds ascend (batches whose slots round to one bound keep the first)."""
    out = []
    for bucket in buckets:
        if not out or dataclasses.astuple(bucket)[0] > dataclasses.astuple(out[-1])[0]:
            out.append(bucket)
    return tuple(out)


def matmul_only(x, experts, w13s, w2s):
    """Each reached expert's two GEMMs on its tokens (gathered beforehand), per layer: what the mixture must do."""
    reached = experts.unique().tolist()
    inputs = {e: x[(experts == e).any(dim=-1)] for e in reached}
    hidden = {e: torch.empty(t.shape[0], w2s[0].shape[2], dtype=x.dtype, device=x.device) for e, t in inputs.items()}

    def run():
        for w13, w2 in zip(w13s, w2s, strict=True):
            for e in reached:
                F.linear(inputs[e], w13[e])
                F.linear(hidden[e], w2[e])

    return run, len(reached)


def fp8_blocks(weight: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked experts [E, N, K] (N, K whole blocks) as an fp8 checkpoint holds them: float8_e4m3fn values and one
    float32 scale (amax / 448) per block, [E, N / block, K / block]."""
    experts, n, k = weight.shape
    blocks = weight.float().view(experts, n // block, block, k // block, block)
    scale = (blocks.abs().amax(dim=(2, 4)) / 448.0).clamp(min=1e-12)
    values = (blocks / scale[:, :, None, :, None]).to(torch.float8_e4m3fn).view(experts, n, k)
    return values, scale


def int4_groups(weight: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stacked experts [E, N, K] (K whole groups) as an AWQ checkpoint holds them, in int4_fused_moe's layout: int32
    words [E, N, K / 8], float32 scales (range / 15) and uint8 zero points [E, N, K / group]."""
    experts, n, k = weight.shape
    groups = weight.float().view(experts, n, k // group, group)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scale = ((high - low) / 15).clamp(min=1e-8)
    zero = (-low / scale).round().clamp(0, 15)
    q = (groups / scale[..., None] + zero[..., None]).round().clamp(0, 15).view(experts, n, k)
    packed = torch.stack([pack_int4_rows(expert) for expert in q])
    return packed, scale, zero.to(torch.uint8)


@dataclasses.dataclass(frozen=True)
class Quantized:
    """A quantized format of the experts: its op, its reference, the argument after the layer's tensors (fp8's block,
    int4's group), its table key, the decode tiles a sweep tries beside SLOT_TILES, and its bytes a weight."""

    name: str
    op: Callable
    reference: Callable
    layout: Any
    table_key: str
    slot_tiles: dict[str, list[tuple[int, int, int]]]
    bytes_per_weight: float


QUANTIZED = {
    # fp8: one byte a weight reads half the bytes a step; these tiles also tried
    "fp8": Quantized(
        "fp8",
        moe.fp8_fused_moe,
        native_ops.fp8_fused_moe,
        (128, 128),
        "fp8_decode",
        {"gate_up": [(4, 1024, 4), (8, 1024, 8)], "down": [(4, 1024, 4), (8, 512, 8)]},
        1.0,
    ),
    # int4: the GEMV's products want rows of 16 words or more a thread-step, as int4_linear's GEMV takes them
    "int4": Quantized(
        "int4",
        moe.int4_fused_moe,
        native_ops.int4_fused_moe,
        128,
        "int4_decode",
        {
            "gate_up": [(8, 1024, 4), (16, 1024, 4), (16, 2048, 8), (32, 1024, 8), (16, 512, 4), (32, 512, 4)],
            "down": [(8, 256, 4), (16, 256, 4), (32, 256, 4), (16, 256, 8), (16, 512, 4), (8, 128, 4), (16, 128, 4)],
        },
        0.5 + 5 / 128,  # the words, and a float32 scale and a uint8 zero point a group of 128
    ),
}


def quantized_row(fmt: Quantized, row, layers, x, logits, top_k, renormalize, table, floor_ms, platform, sweep, decode):
    """The format's op on each path at the table's tiles (the decode path at the format's): its time, its error
    against the reference on the dequantized experts, and the floor of its bytes (`floor_ms`); with `sweep`, int4's
    grouped tiles too, and with `decode` as well the decode path's candidate tiles, one kernel varied at a time, the
    other at the table's tile of the format."""
    prefix = f"{fmt.name}_"
    expected = fmt.reference(x, logits, *layers[0], top_k, renormalize, 0, fmt.layout).float()
    row[f"{prefix}floor_ms"] = floor_ms

    def run(tiles):
        for layer in layers:
            fmt.op(x, logits, *layer, top_k, renormalize, 0, fmt.layout, tiles=tiles)

    for path, forced in {"by_slot": float(x.shape[0] * top_k), "grouped": 0.0}.items():
        tiles = dataclasses.replace(table, decode_max_slots_per_expert=forced, int4_decode_max_slots_per_expert=forced)
        got = fmt.op(x, logits, *layers[0], top_k, renormalize, 0, fmt.layout, tiles=tiles).float()
        row[f"{prefix}{path}_max_error"] = (got - expected).abs().max().item()
        row[f"{prefix}{path}_ms"] = graph_ms(platform, functools.partial(run, tiles))
        if sweep and path == "grouped" and fmt.name == "int4":  # int4's grouped GEMMs have tiles of their own
            for tile in dict.fromkeys((*GROUPED_TILES, *INT4_GROUPED_TILES)):
                varied = dataclasses.replace(tiles, int4_grouped=(GroupedBucket(1 << 30, tile),))
                row[f"int4_grouped_tile_{'x'.join(map(str, tile))}_ms"] = graph_ms(
                    platform, functools.partial(run, varied)
                )
        if sweep and decode and path == "by_slot":
            current = tiles.slot_tiles(x.shape[0] * top_k, fmt.name)
            fixed = {"gate_up": current.gate_up, "down": current.down}
            for kernel, tried in SLOT_TILES.items():
                for tile in dict.fromkeys((*tried, *fmt.slot_tiles[kernel])):
                    bucket = DecodeBucket(1 << 30, **{**fixed, kernel: tile})
                    varied = dataclasses.replace(tiles, **{fmt.table_key: (bucket,)})
                    name = f"{prefix}by_slot_{kernel}_{'x'.join(map(str, tile))}_ms"
                    row[name] = graph_ms(platform, functools.partial(run, varied))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--preset", default="qwen3-30b-a3b")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    parser.add_argument("--layers", type=int, default=4, help="weight copies a replay cycles through")
    parser.add_argument("--sweep", action="store_true", help="time every candidate tile of both paths")
    parser.add_argument("--sweep-slots-up-to", type=int, default=512, help="sweep the decode path's tiles this far")
    parser.add_argument("--fp8", action="store_true", help="also time fp8_fused_moe on fp8 experts (128 x 128 blocks)")
    parser.add_argument("--int4", action="store_true", help="also time int4_fused_moe on int4 experts (groups of 128)")
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--write-table", action="store_true", help=f"with --sweep: write this device's table into {TABLES}"
    )
    args = parser.parse_args()

    platform = select_platform(args.device)
    device, dtype = platform.device(), torch.bfloat16
    shape = decoder_shape(preset_config(args.preset))
    E, H, inter, top_k = shape.moe.num_experts, shape.hidden_size, shape.moe.intermediate_size, shape.moe.top_k
    gen = torch.Generator(device=device).manual_seed(0)
    w13s = [
        torch.randn(E, 2 * inter, H, generator=gen, device=device, dtype=dtype) / H**0.5 for _ in range(args.layers)
    ]
    w2s = [torch.randn(E, H, inter, generator=gen, device=device, dtype=dtype) / inter**0.5 for _ in range(args.layers)]
    expert_bytes = (3 * inter * H) * dtype.itemsize
    formats = {}  # each timed format's experts: one tuple of the op's tensors a layer
    if args.fp8:
        formats["fp8"] = [(*fp8_blocks(w13), *fp8_blocks(w2)) for w13, w2 in zip(w13s, w2s, strict=True)]
    if args.int4:
        formats["int4"] = [(*int4_groups(w13), *int4_groups(w2)) for w13, w2 in zip(w13s, w2s, strict=True)]
    bandwidth = measure_bandwidth(platform, device)
    print(f"{args.preset}: {E} experts, top {top_k}, hidden {H}, expert intermediate {inter}, {args.layers} layers")
    print(f"copy bandwidth {bandwidth.copy_bytes_per_s / 1e9:.0f} GB/s on {platform.capabilities.device_name}")

    results = []
    for batch in args.batch_sizes:
        x = torch.randn(batch, H, generator=gen, device=device, dtype=dtype)
        logits = torch.randn(batch, E, generator=gen, device=device, dtype=dtype)
        _, experts = native_ops.route(logits, top_k, shape.moe.renormalize)
        calibration, reached = matmul_only(x, experts, w13s, w2s)
        floor_ms = reached * expert_bytes * args.layers / bandwidth.copy_bytes_per_s * 1e3
        row = {"batch": batch, "experts_reached": reached, "floor_ms": floor_ms}
        row["matmul_only_ms"] = graph_ms(platform, calibration)
        expected = native_ops.fused_moe(x, logits, w13s[0], w2s[0], top_k, shape.moe.renormalize).float()

        table = tiles_for(platform.capabilities.device_name)

        def run(tiles, x=x, logits=logits):
            for w13, w2 in zip(w13s, w2s, strict=True):
                moe.fused_moe(x, logits, w13, w2, top_k, shape.moe.renormalize, tiles=tiles)

        slots = batch * top_k
        for path, forced in {"by_slot": float(slots), "grouped": 0.0}.items():  # the decode path's bound, forced
            tiles = dataclasses.replace(table, decode_max_slots_per_expert=forced)
            got = moe.fused_moe(x, logits, w13s[0], w2s[0], top_k, shape.moe.renormalize, tiles=tiles).float()
            row[f"{path}_max_error"] = (got - expected).abs().max().item()
            row[f"{path}_ms"] = graph_ms(platform, functools.partial(run, tiles))
            if not args.sweep or (path == "by_slot" and slots > args.sweep_slots_up_to):
                continue
            for name, tile in candidates(path, tiles.slot_tiles(slots)):  # one kernel's tile varied at a time
                if path == "by_slot":
                    bucket = DecodeBucket(1 << 30, **tile)
                    varied = dataclasses.replace(tiles, decode=(bucket,))
                else:
                    varied = dataclasses.replace(tiles, grouped=(GroupedBucket(1 << 30, tile),))
                row[f"{path}_{name}_{'x'.join(map(str, tile if path == 'grouped' else tile[name]))}_ms"] = graph_ms(
                    platform, functools.partial(run, varied)
                )
        for name, layers in formats.items():
            fmt, decode = QUANTIZED[name], batch * top_k <= args.sweep_slots_up_to
            fmt_floor_ms = floor_ms * fmt.bytes_per_weight / dtype.itemsize
            renormalize = shape.moe.renormalize
            quantized_row(
                fmt, row, layers, x, logits, top_k, renormalize, table, fmt_floor_ms, platform, args.sweep, decode
            )
        results.append(row)
        line = (
            f"bs={batch:4d} reached {reached:3d}: floor {floor_ms:7.3f} ms, matmul-only {row['matmul_only_ms']:7.3f}, "
            f"by_slot {row['by_slot_ms']:7.3f} ({row['by_slot_ms'] / floor_ms:.2f}x floor), "
            f"grouped {row['grouped_ms']:7.3f} ({row['grouped_ms'] / floor_ms:.2f}x floor, "
            f"{row['grouped_ms'] / row['matmul_only_ms']:.2f}x matmul-only); "
            f"max error {row['by_slot_max_error']:.3g} / {row['grouped_max_error']:.3g}"
        )
        print(line, flush=True)
        for f in formats:
            print(
                f"    {f} experts: floor {row[f'{f}_floor_ms']:7.3f} ms, by_slot {row[f'{f}_by_slot_ms']:7.3f} "
                f"({row[f'{f}_by_slot_ms'] / row['by_slot_ms']:.2f}x bf16, "
                f"{row[f'{f}_by_slot_ms'] / row[f'{f}_floor_ms']:.2f}x its floor), grouped "
                f"{row[f'{f}_grouped_ms']:7.3f} ({row[f'{f}_grouped_ms'] / row['grouped_ms']:.2f}x bf16); max error "
                f"against the dequantized experts {row[f'{f}_by_slot_max_error']:.3g} / "
                f"{row[f'{f}_grouped_max_error']:.3g}",
                flush=True,
            )
        kernels = [f"{prefix}by_slot_{kernel}" for prefix in ("", "fp8_", "int4_") for kernel in ("gate_up", "down")]
        for group in (*kernels, "grouped_tile", "int4_grouped_tile"):
            tiles = {k: v for k, v in row.items() if k.startswith(f"{group}_")}
            if tiles:
                best = min(tiles, key=tiles.get)
                print(f"    fastest {best}: {tiles[best]:.3f} ms  ({', '.join(f'{v:.3f}' for v in tiles.values())})")
    if args.write_table:
        path = TABLES / table_name(platform.capabilities.device_name)
        swept = swept_table(results, E, top_k)
        current = tiles_for(platform.capabilities.device_name)
        for fmt in QUANTIZED.values():
            if not getattr(swept, fmt.table_key):  # not swept (no --fp8 / --int4): the current table's tiles stay
                swept = dataclasses.replace(swept, **{fmt.table_key: getattr(current, fmt.table_key)})
                if fmt.name == "int4":
                    bound, grouped = current.int4_decode_max_slots_per_expert, current.int4_grouped
                    swept = dataclasses.replace(swept, int4_decode_max_slots_per_expert=bound, int4_grouped=grouped)
                print(f"{fmt.table_key} kept from {current.source} (--{fmt.name} sweeps it)")
        path.write_text(dumps(swept))
        print(f"wrote {path}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"preset": args.preset, "device": platform.capabilities.device_name, "rows": results}, f, indent=1
            )


if __name__ == "__main__":
    main()
