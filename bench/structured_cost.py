"""What a JSON-schema constraint costs: output tokens/s of a batch constrained by a 10-field schema against the same
batch unconstrained (greedy, one process, one device), and the schema's compile time, cold and cached.

Dummy presets have no tokenizer: the embedded model's (512 tokens) stands in, over the preset's vocabulary (the
grammar forbids the tokens past it). The constrained requests end when their JSON does, and each unconstrained one
makes as many tokens as its constrained twin did.

    python bench/structured_cost.py --preset llama-3-8b --device cuda --batch-size 64 \
        --json bench/results/h100_structured_cost.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from omnirun.assets.default_model import default_model_dir
from omnirun.bench_serve import RECORD_SCHEMA as SCHEMA  # (omnirun bench serve --structured json sends it too)
from omnirun.engine import LLM
from omnirun.sampling import SamplingParams
from omnirun.structured import GrammarSpec


def _timed(llm: LLM, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> tuple[float, int]:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, sum(len(o.token_ids) for o in outputs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="llama-3-8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    llm = LLM(
        args.preset,
        load_format="dummy",
        tokenizer=str(default_model_dir()),
        device=args.device,
        dtype=args.dtype,
        max_running_requests=args.batch_size,
        disable_prefix_caching=True,
        progress=False,
    )
    grammars = llm.engine.grammars
    start = time.perf_counter()
    grammars.matcher(GrammarSpec.json_schema({"type": "object"}))  # the backend over the tokenizer, made once
    backend_s = time.perf_counter() - start
    spec = GrammarSpec.json_schema(SCHEMA)
    start = time.perf_counter()
    grammars.matcher(spec)
    cold_s = time.perf_counter() - start
    start = time.perf_counter()
    grammars.matcher(spec)
    cached_s = time.perf_counter() - start

    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, 500, (args.batch_size, args.input_len), generator=gen).tolist()
    constrained = SamplingParams(temperature=0, max_new_tokens=args.output_len, structured_output=spec)
    # The unconstrained requests make as many tokens as each constrained one did: the same prefill, the same steps.
    lengths = [len(o.token_ids) for o in llm.generate(prompts, constrained, use_tqdm=False)]  # (and the warm-up)
    free = [SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True) for n in lengths]
    _timed(llm, prompts, free)
    results = {"preset": args.preset, "batch_size": args.batch_size, "device": llm.runner.capabilities.device_name}
    for name, params in (("unconstrained", free), ("json_schema", constrained)):
        seconds, tokens = _timed(llm, prompts, params)
        results[name] = {"seconds": seconds, "output_tokens": tokens, "tok_per_s": tokens / seconds}
    ratio = results["json_schema"]["tok_per_s"] / results["unconstrained"]["tok_per_s"]
    results.update(backend_s=backend_s, compile_cold_s=cold_s, compile_cached_s=cached_s, ratio=ratio)
    print(f"{args.preset} on {results['device']}, batch {args.batch_size}, {args.input_len} -> up to {args.output_len}")
    for name in ("unconstrained", "json_schema"):
        r = results[name]
        print(f"  {name:14s} {r['tok_per_s']:9.0f} tok/s  ({r['output_tokens']} tokens in {r['seconds']:.2f} s)")
    print(f"  ratio {ratio:.3f}; backend {backend_s * 1e3:.0f} ms, compile cold {cold_s * 1e3:.1f} ms, "
          f"cached {cached_s * 1e3:.2f} ms")  # fmt: skip
    llm.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
