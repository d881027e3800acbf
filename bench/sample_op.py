"""The `sample` op alone, no model: the torch reference against the Triton kernel (top-k rows cut a short list from
torch.topk; `search`: every row searches its whole vocabulary, 16 cuts a pass; `bisection`: 2 cuts a pass) on
random logits of a vocabulary, per batch size and filter setting, with the share of seeded rows on which the
kernel draws the reference's token (the contract: all of them). Two kinds of logits: `randn` (randn x 3, a flat
tail holding most of the mass: the nucleus at top-p 0.95 spans thousands of tokens) and `peaked` (64 tokens at 14,
13.85, ... above randn x 2: at temperature 0.8 the nucleus is about 16 tokens, as a language model's often is).

    python bench/sample_op.py --device cuda --vocab 128256 --batch-sizes 1 64 256 \
        --json bench/results/h200_sample_op.json
"""

from __future__ import annotations

import argparse
import functools
import json

import torch

from omnirun.registry import select_platform
from omnirun.sampling import SamplingBatch, SamplingParams, reference

SETTINGS = {
    "temperature": {"temperature": 0.8},
    "top_k_top_p": {"temperature": 0.8, "top_p": 0.95, "top_k": 50},
    "top_p": {"temperature": 0.8, "top_p": 0.95},
}


def op_ms(platform, op, logits: torch.Tensor, batch: SamplingBatch, repeats: int = 20) -> float:
    """Milliseconds per call of `op`, timed by device events after one call that compiles it."""
    op(logits, batch)
    start, end = platform.event(enable_timing=True), platform.event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        op(logits, batch)
    end.record()
    platform.synchronize()
    return start.elapsed_time(end) / repeats


def _logits(kind: str, batch: int, vocab: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(batch)
    if kind == "randn":
        return torch.randn(batch, vocab, generator=gen) * 3
    logits = torch.randn(batch, vocab, generator=gen) * 2
    for row in logits:
        row[torch.randperm(vocab, generator=gen)[:64]] = 14 - 0.15 * torch.arange(64.0)
    return logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--vocab", type=int, default=128_256)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--logits", nargs="+", choices=["randn", "peaked"], default=["randn", "peaked"])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    from omnirun.kernels.triton.sample import sample as triton_sample  # imports triton

    platform = select_platform(args.device)
    device, dtype = platform.device(), getattr(torch, args.dtype)
    ops = {
        "reference": reference.sample,
        "triton": triton_sample,
        "triton_search": functools.partial(triton_sample, shortlist=False),
        "triton_bisection": functools.partial(triton_sample, pivots=2, shortlist=False),
    }
    results: dict[str, dict[str, float]] = {}
    for kind, bs in ((kind, bs) for kind in args.logits for bs in args.batch_sizes):
        logits = _logits(kind, bs, args.vocab).to(device, dtype)
        for setting, fields in SETTINGS.items():
            params = [SamplingParams(**fields, seed=row) for row in range(bs)]
            batch = SamplingBatch.build(params, [0] * bs, device, vocab_size=args.vocab)
            same = float((triton_sample(logits, batch) == reference.sample(logits, batch)).float().mean())
            row = {f"{name}_ms": op_ms(platform, op, logits, batch) for name, op in ops.items()}
            row["triton_equals_reference"] = same
            results[f"{kind}_bs{bs}_{setting}"] = row
            print(
                f"{kind:6s} bs={bs:4d} {setting:12s} "
                + "  ".join(f"{name[:-3]} {ms:.3f} ms" for name, ms in row.items() if name.endswith("_ms"))
                + f"  same tokens {same:.1%}",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"args": vars(args), "device": platform.capabilities.device_name, "results": results}, f, indent=2
            )


if __name__ == "__main__":
    main()
