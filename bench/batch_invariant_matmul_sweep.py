"""Sweep the batch-invariant Triton matmul's launch per weight shape against cuBLAS (torch's F.linear).

A launch may depend on the weight's shape only, never on the row count, so one launch must serve batch 1 (a weight
stream) and batch 256 (tensor-core work) alike: for each shape this picks the launch with the smallest mean of
(time / cuBLAS time) over the row counts, and prints every measurement.

    python bench/batch_invariant_matmul_sweep.py --shapes llama-3-8b --rows 1 32 256 --json sweep.json
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F
import triton.testing

from omnirun.kernels.triton.matmul import Tiles, batch_invariant_linear

# (name, out_features, in_features) of one decoder layer and the head
SHAPES = {
    "llama-3-8b": [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336),
                   ("lm_head", 128256, 4096)],
    "qwen2.5-0.5b": [("qkv", 1152, 896), ("o", 896, 896), ("gate_up", 9728, 896), ("down", 896, 4864),
                     ("lm_head", 151936, 896)],
}  # fmt: skip


def launches() -> list[Tiles]:
    out = []
    for block_n, block_k, stages, split in itertools.product((32, 64, 128), (64, 128), (3, 4), (1, 2, 4)):
        out.append(Tiles(block_n, block_k, split, stages, 4))
        if block_n == 128:
            out.append(Tiles(block_n, block_k, split, stages, 8))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="llama-3-8b", choices=sorted(SHAPES))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 32, 256])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    results = []
    for name, n, k in SHAPES[args.shapes]:
        weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        xs = {m: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for m in args.rows}
        cublas = {
            m: triton.testing.do_bench(lambda x=xs[m], w=weight: F.linear(x, w), warmup=10, rep=40) for m in args.rows
        }
        best = None
        for launch in launches():
            try:
                times = {}
                for m in args.rows:
                    out = batch_invariant_linear(xs[m], weight, None, launch=launch)
                    err = (out.float() - F.linear(xs[m], weight).float()).abs().max().item()
                    if err > 0.05:
                        raise RuntimeError(f"wrong result (max error {err})")
                    times[m] = triton.testing.do_bench(
                        lambda x=xs[m], w=weight, t=launch: batch_invariant_linear(x, w, None, launch=t),
                        warmup=10,
                        rep=40,
                    )
            except Exception as exc:  # out of shared memory and the like: the launch is not possible here
                results.append({"shape": name, "launch": launch.__dict__, "error": str(exc)[:200]})
                continue
            score = sum(times[m] / cublas[m] for m in args.rows) / len(args.rows)
            row = {"shape": name, "n": n, "k": k, "launch": launch.__dict__, "ms": times, "cublas_ms": cublas,
                   "score": score}  # fmt: skip
            results.append(row)
            if best is None or score < best["score"]:
                best = row
        ratios = ", ".join(f"M={m}: {best['ms'][m] * 1e3:.1f} us ({best['ms'][m] / cublas[m]:.2f}x)" for m in args.rows)
        print(f"{name:8s} N={n:6d} K={k:5d} best {best['launch']} score {best['score']:.3f} | {ratios}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
