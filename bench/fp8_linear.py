"""The platform's `fp8_linear` against its bf16 `linear`, alone, on a preset's four projections (q|k|v, o, gate|up,
down), per batch size: milliseconds for all four over `--layers` copies of the weights (more than the L2 cache
holds), replayed in a device graph as a decode step runs them, and the fp8 floor (the fp8 weights' bytes ÷ the
measured copy bandwidth). `--sweep` also times the weight-only kernel's candidate tiles at each batch up to 16, and
the W8A8 kernel's above, and prints the fastest.

    python bench/fp8_linear.py --device cuda --preset llama-3-8b --batch-sizes 1 4 16 64 256 1024 \
        --json bench/results/h100_fp8_linear.json
"""

from __future__ import annotations

import argparse
import functools
import json

import torch
from graph_timing import graph_ms, projections  # bench/: beside this script

from omnirun.bandwidth import measure_bandwidth
from omnirun.kernels.triton import fp8_linear as kernels
from omnirun.layers.ops import resolve_ops
from omnirun.loader.presets import preset_config
from omnirun.models.architecture import decoder_shape
from omnirun.registry import select_platform

# (N, K, warps, stages) of the weight-only kernel; (M, N, warps, stages) of the W8A8 GEMM
WEIGHT_ONLY_TILES = [
    (4, 1024, 4, 4),
    (8, 1024, 4, 4),
    (8, 2048, 4, 3),
    (16, 1024, 4, 4),
    (16, 512, 4, 4),
    (16, 256, 4, 4),
    (32, 256, 4, 4),
    (32, 512, 8, 4),
    (64, 256, 8, 3),
]
W8A8_TILES = [
    (64, 64, 4, 4),
    (64, 128, 4, 3),
    (64, 128, 4, 4),
    (64, 128, 8, 4),
    (64, 256, 8, 3),
    (128, 128, 8, 3),
    (128, 128, 8, 4),
    (128, 256, 8, 3),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--preset", default="llama-3-8b")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 64, 256, 1024])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--block", type=int, nargs=2, default=None, help="block scales (e.g. 128 128); else per row")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    platform = select_platform(args.device)
    device = platform.device()
    ops = resolve_ops(platform.fused_ops())
    shape = decoder_shape(preset_config(args.preset))
    block = tuple(args.block) if args.block else None
    layers = []
    for _ in range(args.layers):
        for n, k in projections(shape):
            bf16 = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
            scale_shape = (n,) if block is None else (-(-n // block[0]), -(-k // block[1]))
            scale = torch.full(scale_shape, 0.02 / 64, device=device)
            layers.append((bf16, ops.prepare_linear(bf16), (bf16 * 64 / 0.02).to(torch.float8_e4m3fn), scale))
    fp8_bytes = sum(w.numel() for _, _, w, _ in layers)
    bandwidth = measure_bandwidth(platform, device).copy_bytes_per_s
    floor_ms = fp8_bytes / bandwidth * 1e3
    print(
        f"{args.preset} projections x {args.layers} layers, fp8 {'per row' if block is None else list(block)}: "
        f"{fp8_bytes / 1e9:.2f} GB fp8, copy bandwidth {bandwidth / 1e12:.2f} TB/s, fp8 floor {floor_ms:.3f} ms"
    )
    results = {"preset": args.preset, "block": block, "layers": args.layers, "floor_ms": floor_ms, "rows": []}

    def run(x, linear):
        for layer in layers:
            linear(x[:, : layer[0].shape[1]], layer)

    def bf16_linear(x, layer):
        return ops.linear(x, layer[0], None, layer[1])

    def fp8_linear(x, layer, op=ops.fp8_linear):
        return op(x, layer[2], layer[3], None, block)

    width = max(k for _, k in projections(shape))
    for bs in args.batch_sizes:
        x = torch.randn(bs, width, device=device, dtype=torch.bfloat16)
        bf16_ms = graph_ms(platform, functools.partial(run, x, bf16_linear))
        fp8_ms = graph_ms(platform, functools.partial(run, x, fp8_linear))
        row = {"batch": bs, "bf16_ms": bf16_ms, "fp8_ms": fp8_ms, "ratio": fp8_ms / bf16_ms}
        if bs == 1:
            row["fp8_vs_floor"] = fp8_ms / floor_ms
        print(
            f"batch {bs:5d}: bf16 {bf16_ms:7.3f} ms   fp8 {fp8_ms:7.3f} ms   fp8/bf16 {fp8_ms / bf16_ms:5.2f}"
            + (f"   fp8/floor {fp8_ms / floor_ms:4.2f}" if bs == 1 else "")
        )
        if args.sweep:
            tiles = {}
            if bs <= kernels.WEIGHT_ONLY_MAX_ROWS:
                for n, k, warps, stages in WEIGHT_ONLY_TILES:
                    op = functools.partial(
                        kernels.weight_only, block_n=n, block_k=k, num_warps=warps, num_stages=stages
                    )
                    tiles[f"weight_only N{n} K{k} w{warps} s{stages}"] = graph_ms(
                        platform, functools.partial(run, x, functools.partial(fp8_linear, op=op))
                    )
            for m, n, warps, stages in W8A8_TILES:
                op = functools.partial(kernels.w8a8, block_m=m, block_n=n, num_warps=warps, num_stages=stages)
                tiles[f"w8a8 M{m} N{n} w{warps} s{stages}"] = graph_ms(
                    platform, functools.partial(run, x, functools.partial(fp8_linear, op=op))
                )
            best = min(tiles, key=tiles.get)
            print(f"      fastest: {best} {tiles[best]:.3f} ms; " + ", ".join(f"{k} {v:.3f}" for k, v in tiles.items()))
            row["tiles"] = tiles
        results["rows"].append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
