"""The platform's `int4_linear` (W4A16, AWQ/GPTQ kept packed) against its bf16 `linear`, alone, on a preset's four
projections (q|k|v, o, gate|up, down), per batch size: milliseconds for all four over `--layers` copies of the
weights (more than the L2 cache holds), replayed in a device graph as a decode step runs them, and the int4 floor
(the packed words', scales' and zero points' bytes ÷ the measured copy bandwidth). `--sweep` also times the
candidates at each batch (GEMV launches up to GEMV_MAX_ROWS rows; GEMM tiles, K splits and the dequantized weight
above), checks each one's output against bf16 on the dequantized weight, and prints the fastest.

    python bench/int4_linear.py --device cuda --preset llama-3-8b-awq --batch-sizes 1 4 16 64 256 1024 --sweep \
        --json bench/results/h100_int4_linear.json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json

import torch
from graph_timing import graph_ms, projections  # bench/: beside this script

from omnirun.bandwidth import measure_bandwidth
from omnirun.kernels.triton import int4_linear as kernels
from omnirun.kernels.triton.int4_linear import GEMV_MAX_ROWS
from omnirun.layers import native_ops
from omnirun.layers.ops import resolve_ops
from omnirun.loader.presets import preset_config
from omnirun.models.architecture import decoder_shape
from omnirun.quantization.int4 import pack_int4_rows
from omnirun.registry import select_platform

GEMV_TILES = [  # up to GEMV_MAX_ROWS rows: rows a program, N, K step, warps (None: int4_linear.gemv_launch's)
    (None, None, None, None),
    (1, 16, 1024, 4),
    (1, 16, 2048, 8),
    (1, 8, 1024, 4),
    (1, 32, 512, 4),
    (2, 16, 1024, 4),
    (2, 16, 2048, 8),
    (2, 16, 512, 4),
    (2, 32, 256, 2),
]
GEMM_TILES = [  # M, N, K step, warps, stages, K splits
    (16, 128, 128, 4, 3, None),
    (64, 128, 64, 4, 3, 1),
    (64, 128, 128, 4, 3, None),
    (64, 64, 128, 4, 4, None),
    (32, 64, 128, 4, 4, None),
    (128, 128, 64, 8, 3, None),
    (128, 64, 128, 4, 3, None),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--preset", default="llama-3-8b-awq")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 64, 256, 1024])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=None, help="default: the preset's, else 128")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument(
        "--reference", action="store_true", help="time the torch reference (dequantize, then matmul) as the int4 op"
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    platform = select_platform(args.device)
    device = platform.device()
    ops = resolve_ops(platform.fused_ops())
    if args.reference:
        ops = dataclasses.replace(ops, int4_linear=native_ops.int4_linear)
    config = preset_config(args.preset)
    quantization = getattr(config, "quantization_config", None) or {}
    group = args.group_size or quantization.get("group_size") or 128
    shape = decoder_shape(config)
    gen = torch.Generator(device=device).manual_seed(0)
    layers = []
    for _ in range(args.layers):
        for n, k in projections(shape):
            groups = -(-k // group)
            q = torch.randint(0, 16, (n, k), generator=gen, device=device, dtype=torch.int32)
            scale = torch.full((n, groups), 0.02 / 4.6, device=device)
            zero = torch.full((n, groups), 8, device=device, dtype=torch.uint8)
            bf16 = native_dequantized(q, scale, zero, group)
            layers.append((bf16, ops.prepare_linear(bf16), pack_int4_rows(q), scale, zero))
            del q
    int4_bytes = sum(sum(t.numel() * t.element_size() for t in layer[2:]) for layer in layers)
    bandwidth = measure_bandwidth(platform, device).copy_bytes_per_s
    floor_ms = int4_bytes / bandwidth * 1e3
    print(
        f"{args.preset} projections x {args.layers} layers, int4 groups of {group}: {int4_bytes / 1e9:.2f} GB packed "
        f"(with scales and zero points), copy bandwidth {bandwidth / 1e12:.2f} TB/s, int4 floor {floor_ms:.3f} ms; "
        f"int4_linear from {getattr(ops.int4_linear, '__module__', '?')}"
    )
    results = {"preset": args.preset, "group_size": group, "layers": args.layers, "floor_ms": floor_ms, "rows": []}

    def run(x, linear):
        for layer in layers:
            linear(x[:, : layer[0].shape[1]], layer)

    def bf16_linear(x, layer):
        return ops.linear(x, layer[0], None, layer[1])

    def int4_linear(x, layer, op=ops.int4_linear):
        return op(x, layer[2], layer[3], layer[4], None, group)

    width = max(k for _, k in projections(shape))
    for bs in args.batch_sizes:
        x = torch.randn(bs, width, device=device, dtype=torch.bfloat16)
        bf16_ms = graph_ms(platform, functools.partial(run, x, bf16_linear))
        int4_ms = graph_ms(platform, functools.partial(run, x, int4_linear))
        row = {"batch": bs, "bf16_ms": bf16_ms, "int4_ms": int4_ms, "ratio": int4_ms / bf16_ms}
        if bs == 1:
            row["int4_vs_floor"] = int4_ms / floor_ms
        print(
            f"batch {bs:5d}: bf16 {bf16_ms:7.3f} ms   int4 {int4_ms:7.3f} ms   int4/bf16 {int4_ms / bf16_ms:5.2f}"
            + (f"   int4/floor {int4_ms / floor_ms:4.2f}" if bs == 1 else "")
        )
        if args.sweep:
            tiles = {}
            candidates = []
            for rows, n, k, warps in GEMV_TILES if bs <= GEMV_MAX_ROWS else []:
                if rows is None or rows == 1 or bs > 1:
                    op = functools.partial(kernels.gemv, rows=rows, block_n=n, block_k=k, num_warps=warps)
                    name = f"gemv rows {rows or 'A'} N{n or 'A'} K{k or 'A'} w{warps or 'A'}"
                    candidates.append((name, k or 1024, op, 1))
            for m, n, k, warps, stages, split in GEMM_TILES if bs > 1 else []:
                op = functools.partial(
                    kernels.gemm, block_m=m, block_n=n, block_k=k, num_warps=warps, num_stages=stages, split_k=split
                )
                candidates.append((f"gemm M{m} N{n} K{k} w{warps} s{stages} split{split or 'A'}", k, op, bs))
            if bs > 1:
                candidates.append(("dequantize, then linear", group, kernels.dequantized_linear, bs))
            errors = {}
            for name, k, op, rows in candidates:  # rows: 1 where the kernel's K step may hold several groups
                if kernels.fits(group, k, rows):
                    tiles[name] = graph_ms(platform, functools.partial(run, x, functools.partial(int4_linear, op=op)))
                    errors[name] = relative_error(x, layers[-1], functools.partial(int4_linear, op=op), bf16_linear)
            worst = max(errors, key=errors.get)
            print(f"      largest error against bf16 on the dequantized weight: {worst} {errors[worst]:.2e}")
            row["errors"] = errors
            best = min(tiles, key=tiles.get)
            print(f"      fastest: {best} {tiles[best]:.3f} ms; " + ", ".join(f"{k} {v:.3f}" for k, v in tiles.items()))
            row["tiles"] = tiles
        results["rows"].append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


def relative_error(x, layer, op, reference) -> float:
    """max |op - reference| / max |reference| on one layer (each candidate tile checked as it is timed)."""
    rows = x[:, : layer[0].shape[1]]
    expected = reference(rows, layer).float()
    return ((op(rows, layer).float() - expected).abs().max() / expected.abs().max()).item()


def native_dequantized(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int) -> torch.Tensor:
    """The bf16 weight the packed one stands for (the baseline's)."""
    index = torch.arange(q.shape[1], device=q.device) // group
    return ((q - zero[:, index].to(torch.int32)).float() * scale[:, index]).to(torch.bfloat16)


if __name__ == "__main__":
    main()
