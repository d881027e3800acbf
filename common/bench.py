"""`omnirun bench`: offline throughput and latency of the engine on random prompts, and the roofline fraction.

A decode step must read every weight once plus the K/V of every cached token of the batch; at best it takes
(those bytes) / (the device's memory bandwidth). The roofline fraction is that bound over the measured step time,
with the bandwidth measured in the same run by a large device copy (read + write bytes per second).

With `shared_prefix_len` every prompt starts with the same random tokens (a system prompt) before its own
`input_len`: what the prefix cache is for. The result reports the prompt tokens computed and found in the cache.
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from typing import Any

from omnirun.bandwidth import measure_bandwidth
from omnirun.engine import LLM
from omnirun.memory import PagedKVCache
from omnirun.sampling import SamplingParams


def random_prompts(
    num_prompts: int, input_len: int, vocab_size: int, seed: int, shared_prefix_len: int = 0
) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(vocab_size) for _ in range(shared_prefix_len)]
    return [shared + [rng.randrange(vocab_size) for _ in range(input_len)] for _ in range(num_prompts)]


def run_bench(
    llm: LLM,
    *,
    batch_size: int,
    input_len: int,
    output_len: int,
    num_prompts: int,
    seed: int = 0,
    warmup: bool = True,
    shared_prefix_len: int = 0,
    sampling: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run `num_prompts` prompts of `input_len` random tokens (after `shared_prefix_len` tokens common to all),
    `output_len` new tokens each (EOS ignored), at most `batch_size` at a time; return the measurements as a flat
    dict (what --json writes). `sampling`: SamplingParams fields (temperature, top_p, ...; default greedy)."""
    engine, runner = llm.engine, llm.runner
    vocab = runner.shape.vocab_size
    params = SamplingParams(**{"temperature": 0, **(sampling or {})}, max_new_tokens=output_len, ignore_eos=True)
    if warmup:  # first calls pay one-time costs (allocator growth, kernel selection, weight packing)
        # (another seed, so the measured run finds none of its prompts' prefixes cached)
        _status(f"warming up ({min(batch_size, num_prompts)} prompts)")
        warmup_prompts = random_prompts(min(batch_size, num_prompts), input_len, vocab, seed + 1, shared_prefix_len)
        llm.generate(warmup_prompts, params, use_tqdm=False)
    engine.scheduler.max_running_requests = batch_size  # (the engine thread is idle between generate calls)
    engine.decode_steps.clear()
    prefill_before = engine.prefill_stats()
    prompts = random_prompts(num_prompts, input_len, vocab, seed, shared_prefix_len)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=True)
    runner.platform.synchronize()
    elapsed = time.perf_counter() - start
    prefill = engine.prefill_stats()
    computed = prefill.computed_tokens - prefill_before.computed_tokens
    cached = prefill.cached_tokens - prefill_before.cached_tokens

    output_tokens = sum(len(o.token_ids) for o in outputs)
    tpots = [(o.latency_s - o.ttft_s) / (len(o.token_ids) - 1) for o in outputs if len(o.token_ids) > 1]
    full = [s for s in engine.decode_steps if s[1] == min(batch_size, num_prompts)] or engine.decode_steps
    step_s = statistics.median(s[0] for s in full) if full else float("nan")
    kv_tokens = statistics.median(s[2] for s in full) if full else 0
    shape = runner.shape
    kv_bytes_per_token = PagedKVCache.bytes_per_token(
        shape.num_layers, shape.num_kv_heads, shape.head_dim, runner.kv_cache_dtype
    )
    step_bytes = runner.weight_bytes_per_step(min(batch_size, num_prompts)) + kv_tokens * kv_bytes_per_token
    # Seconds of silence otherwise, after the progress bar has finished.
    _status("measuring the memory bandwidth (large copies and sums: seconds)")
    bandwidth = measure_bandwidth(runner.platform, runner.device)
    return {
        "model": runner.config.model,
        "device": str(runner.device),
        "device_name": runner.capabilities.device_name,
        "dtype": str(runner.dtype).removeprefix("torch."),
        "attention": runner.attention.name,
        "graph_runner": runner.describe()["graph_runner"],
        "batch_size": batch_size,
        "input_len": input_len,
        "shared_prefix_len": shared_prefix_len,
        "output_len": output_len,
        "num_prompts": num_prompts,
        "total_s": elapsed,
        "output_tokens_per_s": output_tokens / elapsed,
        "ttft_ms_mean": 1e3 * statistics.fmean(o.ttft_s for o in outputs),
        "tpot_ms_mean": 1e3 * statistics.fmean(tpots) if tpots else float("nan"),
        "decode_step_ms_median": 1e3 * step_s,
        "decode_step_bytes": step_bytes,
        "weight_bytes_per_step": runner.weight_bytes_per_step(min(batch_size, num_prompts)),
        **bandwidth.as_dict(),
        "roofline_fraction_copy_bw": step_bytes / step_s / bandwidth.copy_bytes_per_s,
        "roofline_fraction_read_bw": step_bytes / step_s / bandwidth.read_bytes_per_s,
        "preemptions": engine.scheduler.num_preemptions,
        "prefix_caching": engine.prefix_cache is not None,
        "prefill_tokens_computed": computed,
        "prefill_tokens_cached": cached,
        "prefix_cache_hit_rate": cached / (computed + cached) if computed + cached else 0.0,
    }


def _status(text: str) -> None:
    """Say what the bench does while it prints nothing else (stderr: stdout carries the results)."""
    print(f"omnirun bench: {text} ...", file=sys.stderr, flush=True)


def _row(label: str, value: str, rest: str = "") -> str:
    """One aligned row of the table: label, value right-aligned in its column, then unit and notes."""
    return f"  {label:<19}{value:>10}  {rest}".rstrip()


def format_result(r: dict[str, Any]) -> str:
    prompt = f"({r['shared_prefix_len']} shared + {r['input_len']})" if r["shared_prefix_len"] else r["input_len"]
    if r["prefix_caching"]:
        cache = f"{r['prefix_cache_hit_rate']:.1%}"
        cache_rest = (
            f"hit rate: {r['prefill_tokens_cached']} prompt tokens cached, {r['prefill_tokens_computed']} computed"
        )
    else:
        cache, cache_rest = "off", f"{r['prefill_tokens_computed']} prompt tokens computed"
    return "\n".join(
        [
            f"{r['model']} on {r['device']} ({r['device_name']}), {r['dtype']}, attention {r['attention']}, "
            f"{r['graph_runner']}",
            f"batch {r['batch_size']}, {r['num_prompts']} prompts x {prompt} tokens -> {r['output_len']} new",
            _row("output throughput", f"{r['output_tokens_per_s']:.1f}", f"tok/s  ({r['total_s']:.2f} s)"),
            _row("TTFT (mean)", f"{r['ttft_ms_mean']:.2f}", "ms"),
            _row("TPOT (mean)", f"{r['tpot_ms_mean']:.2f}", "ms"),
            _row("decode step", f"{r['decode_step_ms_median']:.2f}", "ms  (median at full batch)"),
            _row("bytes per step", f"{r['decode_step_bytes'] / 1e9:.3f}", "GB  (weights + KV read)"),
            _row("bandwidth", f"{r['copy_GBps']:.1f}", f"GB/s copy, {r['read_GBps']:.1f} GB/s read"),
            _row(
                "roofline fraction",
                f"{r['roofline_fraction_copy_bw']:.1%}",
                f"of copy bandwidth ({r['roofline_fraction_read_bw']:.1%} of read bandwidth)",
            ),
            _row("prefix cache", cache, cache_rest),
        ]
    )
