"""Skinny linear layers at Llama-3-8B shapes: cuBLAS (torch) against omnirun's Triton GEMV, timed in CUDA graphs.

    python bench/gemv_sweep.py [--json out.json]

Each timing cycles through enough copies of the weight to defeat the L2 cache (a decode step streams every layer's
weight from HBM once), and reports microseconds per call and the weight bytes per second it reaches.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F
import triton.testing

from omnirun.devices.cuda.gemv import gemv

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
CONFIGS = [
    dict(block_n=bn, block_k=bk, num_warps=w, num_stages=s)
    for bn, bk, w, s in itertools.product([8, 16, 32], [256, 512, 1024], [4, 8], [3, 4])
]


def time_per_call(fn, weights, x) -> float:
    def run():
        for w in weights:
            fn(x, w)

    return triton.testing.do_bench_cudagraph(run, rep=50) * 1e3 / len(weights)  # us per call


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = []
    for name, (n, k) in SHAPES.items():
        copies = max(4, (512 << 20) // (n * k * 2))
        weights = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") / 64 for _ in range(copies)]
        nbytes = n * k * 2
        top3: list[dict] = []
        for m in (1, 4, 8):
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            ref = F.linear(x, weights[0])
            torch_us = time_per_call(F.linear, weights, x)
            # Batch 1 sweeps every config; larger batches try batch 1's three best that fit in registers.
            configs = CONFIGS if m == 1 else [c for c in top3 if c["block_n"] * c["block_k"] * m <= 8 * 8192]
            timed = []
            for cfg in configs:
                try:
                    out = gemv(x, weights[0], **cfg)
                    err = (out.float() - ref.float()).abs().max().item()
                    us = time_per_call(lambda a, w, cfg=cfg: gemv(a, w, **cfg), weights, x)
                except Exception as exc:  # a config that does not compile (registers, shared memory)
                    print(f"  {name} m={m} {cfg}: {type(exc).__name__}")
                    continue
                timed.append((us, cfg, err))
            timed.sort(key=lambda t: t[0])
            if m == 1:
                top3[:] = [cfg for _, cfg, _ in timed[:3]]
            if not timed:
                continue
            best = timed[0]
            row = {
                "layer": name,
                "n": n,
                "k": k,
                "m": m,
                "torch_us": torch_us,
                "torch_TBps": nbytes / torch_us / 1e6,
                "gemv_us": best[0],
                "gemv_TBps": nbytes / best[0] / 1e6,
                "gemv_config": best[1],
                "gemv_max_abs_err": best[2],
            }
            rows.append(row)
            print(
                f"{name:8s} m={m}  torch {torch_us:7.2f} us ({row['torch_TBps']:.2f} TB/s)   gemv {best[0]:7.2f} us "
                f"({row['gemv_TBps']:.2f} TB/s) {best[1]} err {best[2]:.3g}",
                flush=True,
            )
        del weights
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
