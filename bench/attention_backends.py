"""Attention backends head to head on one layer: decode and extend kernels at a real model's attention shape.

    python bench/attention_backends.py --json attention_h200.json
    python bench/attention_backends.py --backends triton,flashinfer,flashinfer_cuda_cores --page-size 16

Decode: every request holds `context` tokens and appends one; one layer's forward_decode is timed eagerly (launch
overhead included) and, for backends that support graphs, as a replayed CUDA graph (what a decode step runs).
Extend: each request appends `new` tokens after a cached prefix; forward_extend is timed eagerly. `plan_us` is
init_forward_metadata (once per step, for all layers). Times are medians of triton.testing.do_bench, in
microseconds; `kv_GBps` is the K/V bytes a decode reads over its graph (else eager) time.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from functools import partial

import torch
from triton.testing import do_bench

from omnirun.attention.backend import AttentionBackend, AttentionContext, AttentionLayerSpec
from omnirun.attention.torch_native import TorchNativeAttention
from omnirun.batch import ForwardBatch, build_batch
from omnirun.kernels.triton.attention_backend import TritonAttention
from omnirun.memory import KVMemory, PageAllocator, PagedKVCache, ReqToTokenPool


def _flashinfer(**options) -> Callable[[AttentionContext], AttentionBackend]:
    def build(context: AttentionContext) -> AttentionBackend:
        from omnirun.devices.cuda.flashinfer_backend import FlashInferAttention

        return FlashInferAttention(context, **options)

    return build


BACKENDS: dict[str, Callable[[AttentionContext], AttentionBackend]] = {
    "triton": TritonAttention,
    "flashinfer": _flashinfer(),  # tensor-core decode from a GQA group of 4 (Llama-3-8B's)
    "flashinfer_cuda_cores": _flashinfer(decode_tensor_cores=False),
    "flashinfer_fa3": _flashinfer(prefill_backend="auto"),  # FA3 prefill on Hopper
    "torch_native": TorchNativeAttention,
}


def make_kv(
    num_requests: int, context: int, args: argparse.Namespace, device: torch.device
) -> tuple[KVMemory, AttentionContext, AttentionLayerSpec]:
    """One layer's pool, big enough for every request's `context` tokens, filled with random K/V."""
    ps = args.page_size
    num_pages = num_requests * (-(-context // ps) + 1)
    num_slots = (num_pages + 1) * ps
    cache = PagedKVCache(1, num_slots, args.kv_heads, args.head_dim, torch.bfloat16, device, ps)
    for buf in cache.k_buffers + cache.v_buffers:
        buf.normal_()
    kv = KVMemory(PageAllocator(num_pages, ps), ReqToTokenPool(num_requests, context, device), cache, ps)
    ctx = AttentionContext(kv, device, torch.bfloat16, args.heads, args.kv_heads, args.head_dim, context)
    layer = AttentionLayerSpec(0, args.heads, args.kv_heads, args.head_dim, args.head_dim**-0.5)
    return kv, ctx, layer


def cached_requests(kv: KVMemory, prefix_lens: list[int]) -> list[int]:
    """Requests holding `prefix_lens` tokens, allocated round-robin in chunks so their pages interleave as in
    serving."""
    rows = [kv.new_request() for _ in prefix_lens]
    held = [0] * len(rows)
    chunk = max(64, kv.page_size)
    while held != prefix_lens:
        step = [i for i in range(len(rows)) if held[i] < prefix_lens[i]]
        ends = [min(prefix_lens[i], held[i] + chunk) for i in step]
        kv.alloc_tokens([rows[i] for i in step], [held[i] for i in step], ends)
        for i, end in zip(step, ends, strict=True):
            held[i] = end
    return rows


def qkv(ctx: AttentionContext, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dev = ctx.device
    q = torch.randn(num_tokens, ctx.num_heads * ctx.head_dim, device=dev, dtype=torch.bfloat16)
    k = torch.randn(num_tokens, ctx.num_kv_heads * ctx.head_dim, device=dev, dtype=torch.bfloat16)
    return q, k, torch.randn_like(k)


def plan_us(backend: AttentionBackend, batch: ForwardBatch, reps: int = 20) -> float:
    backend.init_forward_metadata(batch)  # first use: JIT compiles, allocations
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        backend.init_forward_metadata(batch)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps * 1e6


def graph_us(backend: AttentionBackend, batch: ForwardBatch, q, k, v, layer) -> float:
    """One forward_decode captured as a CUDA graph through the backend's graph hooks, timed by replays."""
    backend.init_graph_state(batch.batch_size)
    backend.init_forward_metadata_capture(batch)
    for _ in range(2):
        backend.forward_decode(q, k, v, layer, batch)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        backend.forward_decode(q, k, v, layer, batch)
    backend.init_forward_metadata_replay(batch, batch.batch_size)
    return do_bench(graph.replay, return_mode="median") * 1e3


def bench_decode(names: list[str], batch_size: int, context: int, args: argparse.Namespace) -> list[dict]:
    kv, ctx, layer = make_kv(batch_size, context, args, torch.device("cuda"))
    rows = cached_requests(kv, [context - 1] * batch_size)
    batch = build_batch(kv, rows, [context - 1] * batch_size, [[1]] * batch_size, ctx.device)
    q, k, v = qkv(ctx, batch_size)
    kv_bytes = 2 * batch_size * context * args.kv_heads * args.head_dim * 2
    results = []
    for name in names:
        backend = BACKENDS[name](ctx)
        row = {"mode": "decode", "backend": name, "batch_size": batch_size, "context": context}
        row["plan_us"] = plan_us(backend, batch)
        row["eager_us"] = do_bench(partial(backend.forward_decode, q, k, v, layer, batch), return_mode="median") * 1e3
        row["graph_us"] = graph_us(backend, batch, q, k, v, layer) if backend.supports_graph else None
        row["kv_GBps"] = kv_bytes / ((row["graph_us"] or row["eager_us"]) * 1e3)
        results.append(row)
    return results


def bench_extend(names: list[str], batch_size: int, prefix: int, new: int, args: argparse.Namespace) -> list[dict]:
    kv, ctx, layer = make_kv(batch_size, prefix + new, args, torch.device("cuda"))
    rows = cached_requests(kv, [prefix] * batch_size)
    batch = build_batch(kv, rows, [prefix] * batch_size, [[1] * new] * batch_size, ctx.device)
    q, k, v = qkv(ctx, batch.num_tokens)
    results = []
    for name in names:
        backend = BACKENDS[name](ctx)
        row = {"mode": "extend", "backend": name, "batch_size": batch_size, "context": prefix + new, "new": new}
        row["plan_us"] = plan_us(backend, batch)
        row["eager_us"] = do_bench(partial(backend.forward_extend, q, k, v, layer, batch), return_mode="median") * 1e3
        results.append(row)
    return results


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="triton,flashinfer,torch_native", help=f"of {', '.join(BACKENDS)}")
    parser.add_argument("--batch-sizes", default="1,8,32,128")
    parser.add_argument("--contexts", default="128,2048", help="decode: tokens per request, the new one included")
    parser.add_argument("--extend-batch-sizes", default="1,8")
    parser.add_argument("--extend-prefixes", default="0,1920", help="extend: cached tokens before the new ones")
    parser.add_argument("--extend-new", type=int, default=128, help="extend: new tokens per request")
    # Llama-3-8B's attention (per GPU at tensor parallel 1).
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--page-size", type=int, default=1)
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()

    names = [b for b in args.backends.split(",") if b]
    rows = []
    for context in _ints(args.contexts):
        for batch_size in _ints(args.batch_sizes):
            rows += _print(bench_decode(names, batch_size, context, args))
    for prefix in _ints(args.extend_prefixes):
        for batch_size in _ints(args.extend_batch_sizes):
            rows += _print(bench_extend(names, batch_size, prefix, args.extend_new, args))
    if args.json:
        meta = {
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "shape": {k: getattr(args, k) for k in ("heads", "kv_heads", "head_dim", "page_size")},
            "versions": _versions(),
        }
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


def _print(rows: list[dict]) -> list[dict]:
    for r in rows:
        if r["mode"] == "decode":
            graph = f"{r['graph_us']:9.1f}" if r["graph_us"] is not None else "        -"
            tail = f"graph {graph}  KV GB/s {r['kv_GBps']:6.0f}"
        else:
            tail = f"new tokens {r['new']}"
        print(
            f"{r['mode']:6} {r['backend']:22} bs={r['batch_size']:<4} ctx={r['context']:<5} "
            f"plan {r['plan_us']:8.1f}  eager {r['eager_us']:9.1f}  {tail}",
            flush=True,
        )
    return rows


def _versions() -> dict[str, str | None]:
    import importlib.metadata

    out = {}
    for dist in ("triton", "flashinfer-python", "apache-tvm-ffi"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out


if __name__ == "__main__":
    main()
