"""`omnirun bench serve`: load on a running OpenAI-compatible server, as `vllm bench serve` does.

Requests of random token ids (fixed lengths, or uniform in [len * (1 - r), len * (1 + r)] with
--random-range-ratio r) go to /v1/completions as streams, arriving as a Poisson process at --request-rate per
second (inf: all at once), at most --max-concurrency in flight. Each stream's chunk times give its TTFT
(request sent to first token), ITL (between chunks) and TPOT ((latency - TTFT) / (tokens - 1)). With --structured
json every request's output must match RECORD_SCHEMA (`response_format` json_schema): the grammar's overhead, against
a run without it; such a request ends when its JSON does.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import random
import statistics
import time
from pathlib import Path
from typing import Any

from omnirun.errors import OmnirunError

# A record of ten fields, every value bounded (a random model's strings end when their length runs out).
RECORD_SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 100000},
        "name": {"type": "string", "maxLength": 16},
        "email": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "active": {"type": "boolean"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4},
        "city": {"type": "string", "maxLength": 16},
        "notes": {"type": "string", "maxLength": 32},
    },
    "required": ["id", "name", "email", "age", "score", "active", "role", "tags", "city", "notes"],
    "additionalProperties": False,
}


def add_bench_serve_parser(bench: argparse.ArgumentParser) -> None:
    modes = bench.add_subparsers(dest="bench_mode", metavar="MODE", required=False)
    serve = modes.add_parser("serve", help="load a running server (omnirun serve, or any OpenAI-compatible one)")
    serve.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (default: %(default)s)")
    serve.add_argument("--model", default=None, help="model name to send (default: the server's first model)")
    serve.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    serve.add_argument("--num-prompts", type=int, default=100)
    serve.add_argument("--input-len", type=int, default=128)
    serve.add_argument("--output-len", type=int, default=128)
    serve.add_argument("--random-range-ratio", type=float, default=0.0, help="0: fixed lengths (the default)")
    serve.add_argument("--vocab-size", type=int, default=256, help="prompt token ids are drawn from [0, this)")
    serve.add_argument("--request-rate", type=float, default=math.inf, help="requests per second, or inf")
    serve.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    serve.add_argument("--seed", type=int, default=0)
    serve.add_argument(
        "--structured",
        choices=["none", "json"],
        default="none",
        help="json: outputs constrained by a 10-field JSON schema (default: %(default)s)",
    )
    serve.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")
    serve.add_argument("--no-progress", action="store_true", help="no progress bar")
    serve.set_defaults(func=cmd_bench_serve)


@dataclasses.dataclass
class RequestResult:
    ok: bool
    input_len: int
    sent_s: float = 0.0  # when it was sent, from the start of the run
    output_tokens: int = 0
    ttft_s: float = 0.0
    latency_s: float = 0.0
    itl_s: list[float] = dataclasses.field(default_factory=list)
    error: str = ""


def make_requests(args: argparse.Namespace) -> list[tuple[list[int], int]]:
    rng = random.Random(args.seed)
    r = args.random_range_ratio

    def length(n: int) -> int:
        return max(1, rng.randint(int(n * (1 - r)), int(n * (1 + r)))) if r else n

    out = []
    for _ in range(args.num_prompts):
        prompt = [rng.randrange(args.vocab_size) for _ in range(length(args.input_len))]
        out.append((prompt, length(args.output_len)))
    return out


async def _one(session: Any, url: str, body: dict, headers: dict, run_start: float) -> RequestResult:
    start = time.perf_counter()
    result = RequestResult(ok=False, input_len=len(body["prompt"]), sent_s=start - run_start)
    last = None
    try:
        async with session.post(url, json=body, headers=headers) as response:
            if response.status != 200:
                text = await response.text(errors="replace")
                result.error = f"HTTP {response.status}: {text[:200]}"
                return result
            async for raw in response.content:  # line by line
                line = raw.decode().rstrip("\r\n")
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if not chunk.get("choices"):
                    continue
                if last is None:
                    result.ttft_s = now - start
                else:
                    result.itl_s.append(now - last)
                last = now
        result.latency_s = time.perf_counter() - start
        result.ok = last is not None
        if not result.ok:
            result.error = "the stream carried no token"
    except Exception as exc:  # a refused connection, a broken stream: counted as a failed request
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def run_load(args: argparse.Namespace, model: str) -> tuple[list[RequestResult], float]:
    # aiohttp, as vLLM's benchmark client: with a few hundred open streams httpx's pure-Python parsing made the
    # load generator a bottleneck of what it measures (README, "Serving over HTTP").
    import aiohttp
    from tqdm.auto import tqdm

    requests = make_requests(args)
    url = args.base_url.rstrip("/") + "/v1/completions"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limit = asyncio.Semaphore(args.max_concurrency or len(requests))
    rng = random.Random(args.seed + 1)
    bar = tqdm(total=len(requests), desc="requests", unit="req", disable=args.no_progress)

    async def limited(client: Any, body: dict) -> RequestResult:
        async with limit:
            result = await _one(client, url, body, headers, start)
        bar.update(1)
        return result

    connector = aiohttp.TCPConnector(limit=0)  # no cap on connections: --max-concurrency is the only limit
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as client:
        tasks = []
        start = time.perf_counter()
        for i, (prompt, output_len) in enumerate(requests):
            if i and math.isfinite(args.request_rate):  # Poisson arrivals: exponential gaps
                await asyncio.sleep(rng.expovariate(args.request_rate))
            body = {
                "model": model,
                "prompt": prompt,
                "max_tokens": output_len,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            if args.structured == "json":
                body["response_format"] = {
                    "type": "json_schema",
                    "json_schema": {"name": "record", "schema": RECORD_SCHEMA},
                }
            tasks.append(asyncio.create_task(limited(client, body)))
        results = await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - start
    bar.close()
    return results, elapsed


def _stats(name: str, values: list[float]) -> dict[str, float]:
    """mean, p50, p90, p99 of `values` (seconds) in milliseconds."""
    if not values:
        return {f"{name}_ms_{k}": float("nan") for k in ("mean", "p50", "p90", "p99")}
    q = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else [values[0]] * 99
    return {
        f"{name}_ms_mean": 1e3 * statistics.fmean(values),
        f"{name}_ms_p50": 1e3 * q[49],
        f"{name}_ms_p90": 1e3 * q[89],
        f"{name}_ms_p99": 1e3 * q[98],
    }


def summarize(args: argparse.Namespace, model: str, results: list[RequestResult], elapsed: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    tpots = [(r.latency_s - r.ttft_s) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    failed = [r.error for r in results if not r.ok]
    return {
        "base_url": args.base_url,
        "model": model,
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "random_range_ratio": args.random_range_ratio,
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
        "max_concurrency": args.max_concurrency,
        "structured": args.structured,
        "duration_s": elapsed,
        "completed": len(ok),
        "failed": len(failed),
        "first_error": failed[0] if failed else None,
        "total_input_tokens": sum(r.input_len for r in ok),
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / elapsed,
        "output_tokens_per_s": output_tokens / elapsed,
        "total_tokens_per_s": (output_tokens + sum(r.input_len for r in ok)) / elapsed,
        **_stats("ttft", [r.ttft_s for r in ok]),
        **_stats("tpot", tpots),
        **_stats("itl", [t for r in ok for t in r.itl_s]),
        # Each request in the order sent, to look behind a percentile (which requests were slow, and when).
        "requests": [
            {
                "sent_s": r.sent_s,
                "ttft_ms": 1e3 * r.ttft_s if r.ok else None,
                "latency_ms": 1e3 * r.latency_s if r.ok else None,
                "output_tokens": r.output_tokens,
                "error": r.error or None,
            }
            for r in results
        ],
    }


def format_summary(s: dict[str, Any]) -> str:
    lines = [
        f"{s['completed']} of {s['num_prompts']} requests completed in {s['duration_s']:.2f} s "
        f"(rate {s['request_rate']}, concurrency {s['max_concurrency'] or 'unlimited'}"
        f"{', JSON schema' if s.get('structured') == 'json' else ''}); {s['failed']} failed",
        f"  request throughput {s['request_throughput']:10.2f} req/s",
        f"  output throughput  {s['output_tokens_per_s']:10.1f} tok/s",
        f"  total throughput   {s['total_tokens_per_s']:10.1f} tok/s",
    ]
    for name in ("ttft", "tpot", "itl"):
        lines.append(
            f"  {name.upper():<5} ms  mean {s[f'{name}_ms_mean']:9.2f}  p50 {s[f'{name}_ms_p50']:9.2f}  "
            f"p90 {s[f'{name}_ms_p90']:9.2f}  p99 {s[f'{name}_ms_p99']:9.2f}"
        )
    if s["first_error"]:
        lines.append(f"  first error: {s['first_error']}")
    return "\n".join(lines)


def _check(args: argparse.Namespace) -> None:
    for flag in ("num_prompts", "input_len", "output_len", "vocab_size"):
        if getattr(args, flag) < 1:
            raise OmnirunError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if not args.request_rate > 0:
        raise OmnirunError(f"--request-rate must be > 0 (or inf), got {args.request_rate}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise OmnirunError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if not 0 <= args.random_range_ratio < 1:
        raise OmnirunError(f"--random-range-ratio must be in [0, 1), got {args.random_range_ratio}")
    if args.json and not Path(args.json).resolve().parent.is_dir():
        raise OmnirunError(f"--json {args.json}: its folder does not exist; create it or name another file")


def _served_model(args: argparse.Namespace) -> str:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        response = httpx.get(args.base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
    except httpx.HTTPError as exc:
        raise OmnirunError(
            f"cannot reach the server at {args.base_url}: {exc}; start it with `omnirun serve`"
        ) from None
    if response.status_code != 200:
        raise OmnirunError(f"{args.base_url}/v1/models answered HTTP {response.status_code}: {response.text[:200]}")
    return response.json()["data"][0]["id"]


def cmd_bench_serve(args: argparse.Namespace) -> int:
    _check(args)
    model = args.model or _served_model(args)
    results, elapsed = asyncio.run(run_load(args, model))
    summary = summarize(args, model, results, elapsed)
    print(format_summary(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
        print(f"wrote {args.json}")
    return 0 if summary["completed"] else 1
