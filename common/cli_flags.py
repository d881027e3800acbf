"""Command-line flags of the runner and engine, named as in vLLM and SGLang, shared by `generate` and `bench`."""

from __future__ import annotations

import argparse
from typing import Any

from omnirun.config import DTYPES, LOAD_FORMATS

# (flag, type, help); dest is the flag without dashes, which is also the RunnerConfig / engine argument name.
_VALUE_FLAGS: list[tuple[str, type, str]] = [
    ("--tokenizer", str, "HF tokenizer directory (default: the model's)"),
    ("--kv-cache-dtype", str, "auto | bf16 | fp16 | fp32 | fp8_e4m3 | fp8_e5m2"),
    ("--page-size", int, "tokens per KV-cache page"),
    ("--mem-fraction-static", float, "share of device memory for weights + KV cache (default: the platform's)"),
    ("--max-total-tokens", int, "cap on the KV pool in tokens"),
    ("--max-running-requests", int, "requests decoded together at most (default: from the KV pool, 256..1024)"),
    ("--max-graph-batch-size", int, "largest decode batch run as a captured graph (default: the platform's)"),
    ("--context-length", int, "longest prompt + output (default: the model's max_position_embeddings)"),
    ("--attention-backend", str, "attention backend for prefill and decode"),
    ("--prefill-attention-backend", str, "attention backend for prefill only"),
    ("--decode-attention-backend", str, "attention backend for decode only"),
    ("--max-prefill-tokens", int, "tokens one prefill step computes at most"),
    ("--chunked-prefill-size", int, "largest piece of one prompt per prefill step"),
    ("--seed", int, "seed of dummy weights and of unseeded sampling"),
    ("--tp-size", int, "tensor-parallel size: ranks (devices) the model is split over"),
    ("--nnodes", int, "nodes the ranks are spread over (default 1)"),
    ("--node-rank", int, "this node's index, 0..nnodes-1"),
    ("--dist-init-addr", str, "node 0's rendezvous address HOST:PORT (several nodes)"),
    ("--dist-timeout", float, "seconds to wait for every rank to join, and for each collective"),
]


def add_runner_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default=None, help="HF model directory, or a preset with --load-format dummy (default: embedded)"
    )
    parser.add_argument("--device", default=None, help="cuda | rocm | npu | xpu | cpu | auto | <plugin>")
    parser.add_argument("--dtype", default=None, choices=DTYPES)
    parser.add_argument("--load-format", default=None, choices=LOAD_FORMATS)
    for flag, kind, text in _VALUE_FLAGS:
        parser.add_argument(flag, type=kind, default=None, help=text)
    parser.add_argument("--disable-graph", action="store_true", default=None, help="run every step eagerly")
    parser.add_argument(
        "--disable-overlap-schedule",
        action="store_true",
        default=None,
        help="schedule each step only after the previous one finished (default: overlap where kernels run async)",
    )
    parser.add_argument(
        "--disable-prefix-caching",
        action="store_true",
        default=None,
        help="recompute every prompt (default: requests share the KV pages of prefixes computed before)",
    )
    parser.add_argument(
        "--deterministic",
        action="store_true",
        default=None,
        help="batch-invariant kernels: the same prompt and sampling params give the same tokens whatever else runs",
    )


def llm_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The flags the user gave (unset ones are left to the defaults), as LLM keyword arguments."""
    flags = ["disable_graph", "disable_overlap_schedule", "disable_prefix_caching", "deterministic"]
    names = ["device", "dtype", "load_format", *flags] + [f.lstrip("-").replace("-", "_") for f, _, _ in _VALUE_FLAGS]
    return {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}
