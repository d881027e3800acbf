"""Command-line flags of the runner and engine, named as in vLLM and SGLang, shared by `generate` and `bench`."""

from __future__ import annotations

import argparse
from typing import Any

from omnirun.config import DTYPES, LOAD_FORMATS

# (flag, type, help); dest is the flag without dashes, which is also the RunnerConfig / engine argument name. Every
# default is None ("not given": the runner decides), so each help names the default in words.
_VALUE_FLAGS: list[tuple[str, type, str]] = [
    ("--tokenizer", str, "HF tokenizer directory (default: the model directory's)"),
    ("--kv-cache-dtype", str, "auto | bf16 | fp16 | fp32 | fp8_e4m3 | fp8_e5m2 (default: auto, the model's dtype)"),
    ("--page-size", int, "tokens per KV-cache page (default: 1)"),
    (
        "--mem-fraction-static",
        float,
        "share of device memory for weights + KV cache (default: the platform's, 0.85; 0.4 on the CPU)",
    ),
    (
        "--max-total-tokens",
        int,
        "KV pool size in tokens (default: what memory holds, at most running limit x context length; on the CPU "
        "also at most 4 GiB)",
    ),
    ("--max-running-requests", int, "requests decoded together at most (default: from the KV pool, 256..1024)"),
    ("--max-graph-batch-size", int, "largest decode batch run as a captured graph (default: the platform's, 256)"),
    (
        "--context-length",
        int,
        "longest prompt + output (default: the model's max_position_embeddings; more needs "
        "OMNIRUN_ALLOW_LONG_CONTEXT=1)",
    ),
    ("--attention-backend", str, "attention backend for prefill and decode (default: the platform's; see omnirun env)"),
    ("--prefill-attention-backend", str, "attention backend for prefill only (default: --attention-backend)"),
    ("--decode-attention-backend", str, "attention backend for decode only (default: --attention-backend)"),
    ("--max-prefill-tokens", int, "tokens one prefill step computes at most (default: 8192)"),
    ("--chunked-prefill-size", int, "largest piece of one prompt per prefill step (default: --max-prefill-tokens)"),
    ("--seed", int, "seed of dummy weights and of unseeded sampling (default: 0)"),
    ("--tp-size", int, "tensor-parallel size: ranks (devices) the model is split over (default: 1)"),
    ("--nnodes", int, "nodes the ranks are spread over (default: 1)"),
    ("--node-rank", int, "this node's index, 0..nnodes-1 (default: 0)"),
    ("--dist-init-addr", str, "node 0's rendezvous address HOST:PORT, for several nodes (default: none)"),
    (
        "--dist-timeout",
        float,
        "seconds to wait for every rank to join, and for each collective (default: 300 to join, torch's for "
        "collectives)",
    ),
]


def add_runner_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=None,
        help="HF model directory, or a preset with --load-format dummy (default: the embedded model)",
    )
    parser.add_argument(
        "--device",
        default=None,
        help="cuda | rocm | npu | xpu | cpu | auto | <plugin> (default: $OMNIRUN_DEVICE, else auto)",
    )
    parser.add_argument(
        "--dtype",
        default=None,
        choices=DTYPES,
        help="model dtype (default: auto, the checkpoint's where the device computes in it, else the device's best)",
    )
    parser.add_argument(
        "--load-format",
        default=None,
        choices=LOAD_FORMATS,
        help="auto or safetensors read the checkpoint; dummy draws random weights (default: auto)",
    )
    for flag, kind, text in _VALUE_FLAGS:
        parser.add_argument(flag, type=kind, default=None, help=text)
    parser.add_argument("--disable-graph", action="store_true", default=None, help="run every decode step eagerly")
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
        "--skip-warmup",
        dest="warmup",
        action="store_false",
        default=None,
        help="answer ready before the kernels that compile on first use are built (default: warm up first where "
        "the device compiles Triton kernels; the start-up line says how long it took)",
    )
    parser.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        default=None,
        help="mixtures of experts: place whole experts on the --tp-size ranks (default: split every expert's columns)",
    )
    parser.add_argument(
        "--deterministic",
        action="store_true",
        default=None,
        help="batch-invariant kernels: the same prompt and sampling params give the same tokens whatever else runs",
    )


def llm_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The flags the user gave (unset ones are left to the defaults), as LLM keyword arguments."""
    flags = [
        "disable_graph",
        "disable_overlap_schedule",
        "disable_prefix_caching",
        "warmup",
        "deterministic",
        "enable_expert_parallel",
    ]
    names = ["device", "dtype", "load_format", *flags] + [f.lstrip("-").replace("-", "_") for f, _, _ in _VALUE_FLAGS]
    return {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}
