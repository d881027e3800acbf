"""Launch settings of the Triton decode attention kernel, swept: which key block, warps, pipeline stages and split
count read the KV cache fastest at each batch size and context length.

    python bench/decode_tuning.py --batch-sizes 1 32 128 256 512 --contexts 192 512 2048 --json tuning.json

Each case holds one layer's worth of K/V per request at Llama-3-8B's attention shape (32 query heads, 8 KV heads,
head dim 128, bf16), in pages interleaved as serving leaves them. A CUDA graph replays the kernel over several such
layers in turn (as many as keep their K/V out of L2 between visits, up to `--layers`), so a time is what one layer of
a decode step pays, launch gaps included; `GB/s` is the K/V bytes read over that time. The fastest settings per case
are printed first, then the times of the portable default launch and of the one the cuda platform builds.
"""

from __future__ import annotations

import argparse
import itertools
import json
import types

import torch
from attention_backends import cached_requests, make_kv
from triton.testing import do_bench

from omnirun.batch import build_batch
from omnirun.kernels.triton.decode import decode_attention, partial_buffers

L2_BYTES = 64 << 20  # larger than an H200's 50 MiB L2: layers beyond this much K/V find none of it cached


def case_layers(batch_size: int, context: int, args: argparse.Namespace) -> list:
    """The layers' K/V pools of one case, filled and holding `batch_size` requests of `context - 1` tokens."""
    per_layer = 2 * batch_size * context * args.kv_heads * args.head_dim * 2
    count = max(2, min(args.layers, -(-L2_BYTES // per_layer) + 1))
    layers = []
    for _ in range(count):
        kv, ctx, _ = make_kv(batch_size, context, args, torch.device("cuda"))
        rows = cached_requests(kv, [context - 1] * batch_size)
        batch = build_batch(kv, rows, [context - 1] * batch_size, [[1]] * batch_size, ctx.device)
        layers.append((kv, batch))
    return layers


def time_setting(
    layers: list,
    q: torch.Tensor,
    block_n: int,
    warps: int,
    stages: int,
    splits: int,
    pdl: bool = False,
) -> float:
    """Microseconds per layer of a graph replaying the kernel once per layer."""
    batch_size, heads, head_dim = q.shape
    part_out, part_lse = partial_buffers(batch_size, heads, splits, head_dim, q.device)
    out = torch.empty_like(q)

    def run() -> None:
        for kv, batch in layers:
            k_cache, v_cache = kv.kv_cache.get_kv(0)
            decode_attention(
                q, k_cache, v_cache, kv.req_to_token.table, batch.req_pool_indices, batch.seq_lens,
                part_out, part_lse, out, head_dim**-0.5, block_n=block_n, num_warps=warps, num_stages=stages,
                pdl=pdl,
            )  # fmt: skip

    run()  # compiles
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return do_bench(graph.replay, warmup=5, rep=25, return_mode="median") * 1e3 / len(layers)


def split_counts(args: argparse.Namespace, batch_size: int, default: int) -> list[int]:
    """The split counts worth timing at this batch size: one, the default, and those making between
    --min-programs and --max-programs programs."""
    programs = batch_size * args.kv_heads
    fits = [s for s in args.splits if s == 1 or args.min_programs <= programs * s <= args.max_programs]
    return sorted({*fits, default})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32, 128, 256, 512])
    parser.add_argument("--contexts", type=int, nargs="+", default=[192, 512, 2048])
    parser.add_argument("--block-n", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--num-warps", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--num-stages", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--pdl", action="store_true", help="launch as the cuda platform does, with PDL")
    parser.add_argument("--min-programs", type=int, default=256, help="skip split counts making fewer programs")
    parser.add_argument("--max-programs", type=int, default=8192, help="skip split counts making more programs")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--top", type=int, default=3)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--page-size", type=int, default=1)
    parser.add_argument("--json")
    args = parser.parse_args()
    from omnirun.kernels.triton.attention_backend import TritonAttention

    rows = []
    for context, batch_size in itertools.product(args.contexts, args.batch_sizes):
        layers = case_layers(batch_size, context, args)
        q = torch.randn(batch_size, args.heads, args.head_dim, device="cuda", dtype=torch.bfloat16)
        kv_bytes = 2 * batch_size * context * args.kv_heads * args.head_dim * 2
        # The backend's own split count for this batch (what a captured graph of this size uses).
        default_splits = TritonAttention(types.SimpleNamespace(num_kv_heads=args.kv_heads)).decode_splits(batch_size)
        times = []
        for block_n, warps, stages, splits in itertools.product(
            args.block_n, args.num_warps, args.num_stages, split_counts(args, batch_size, default_splits)
        ):
            try:
                us = time_setting(layers, q, block_n, warps, stages, splits, args.pdl)
            except Exception as e:  # noqa: BLE001 (out of shared memory or registers: a setting, not a bug)
                print(f"  skip block_n={block_n} warps={warps} stages={stages} splits={splits}: {type(e).__name__}")
                continue
            times.append({"block_n": block_n, "num_warps": warps, "num_stages": stages, "splits": splits, "us": us})
        times.sort(key=lambda t: t["us"])
        setting = lambda t: (t["block_n"], t["num_warps"], t["num_stages"], t["splits"])  # noqa: E731
        # The portable backend's launch (two stages) and the one the cuda platform builds (three).
        defaults = {
            tag: next((t for t in times if setting(t) == (64, 4, stages, default_splits)), None)
            for tag, stages in (("portable", 2), ("cuda", 3))
        }
        for tag, t in [("best", t) for t in times[: args.top]] + [(k, v) for k, v in defaults.items() if v]:
            print(
                f"bs={batch_size:<4} ctx={context:<5} {tag:8} block_n={t['block_n']:<3} warps={t['num_warps']} "
                f"stages={t['num_stages']} splits={t['splits']:<2} {t['us']:8.2f} us  "
                f"{kv_bytes / t['us'] / 1e3:6.0f} GB/s",
                flush=True,
            )
        rows.append({"batch_size": batch_size, "context": context, "kv_bytes": kv_bytes, "times": times})
        del layers
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
