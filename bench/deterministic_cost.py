"""What deterministic mode costs: the decode step and offline throughput with --deterministic against the default,
in one process on the same device, plus a check that it does what it is for (one prompt's tokens alone and inside a
batch of 64 others).

    python bench/deterministic_cost.py --preset llama-3-8b --device cuda --batch-sizes 1 32 256 --offline 1000 256 256 \
        --json bench/results/h200_deterministic.json

`--linear-blocks` adds a third run: deterministic mode with the reference linear (fixed 32-row blocks through the
platform's own matmul) instead of the Triton batch-invariant matmul, to compare the two.
"""

from __future__ import annotations

import argparse
import json
import time

from omnirun.bench import random_prompts, run_bench
from omnirun.engine import LLM
from omnirun.sampling import SamplingParams


def _without_triton_matmul() -> None:
    """Deterministic mode then falls back to the reference linear: the op table no longer offers the kernel."""
    import omnirun.kernels.triton.ops as triton_ops

    offered = triton_ops.triton_fused_ops

    def without(*args, **kwargs):
        ops = offered(*args, **kwargs)
        ops.pop("batch_invariant_linear", None)
        return ops

    triton_ops.triton_fused_ops = without


def _invariance(llm: LLM, vocab: int, input_len: int, output_len: int) -> dict[str, object]:
    params = SamplingParams(temperature=0, max_new_tokens=output_len, ignore_eos=True)
    prompt = random_prompts(1, input_len, vocab, seed=123)[0]
    others = random_prompts(64, input_len, vocab, seed=456)
    alone = llm.generate([prompt], params, use_tqdm=False)[0].token_ids
    batch = others[:32] + [prompt] + others[32:]
    inside = llm.generate(batch, params, use_tqdm=False)[32].token_ids
    first_difference = next((i for i, (a, b) in enumerate(zip(alone, inside, strict=True)) if a != b), None)
    return {"same_tokens_alone_and_in_batch_of_65": alone == inside, "first_different_token": first_difference}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="llama-3-8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32, 256])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--offline", type=int, nargs=3, metavar=("N", "IN", "OUT"), default=None)
    parser.add_argument("--linear-blocks", action="store_true", help="also run with the reference linear")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    modes = [("default", False), ("deterministic", True)] + (
        [("deterministic_blocks", True)] if args.linear_blocks else []
    )
    max_bs = max(args.batch_sizes + ([256] if args.offline else []))
    results: dict[str, dict[str, object]] = {}
    for name, deterministic in modes:
        if name == "deterministic_blocks":
            _without_triton_matmul()
        start = time.perf_counter()
        llm = LLM(
            args.preset,
            load_format="dummy",
            device=args.device,
            dtype=args.dtype,
            max_running_requests=max_bs,
            deterministic=deterministic,
        )
        result: dict[str, object] = {"startup_s": time.perf_counter() - start, "describe": llm.runner.describe()}
        vocab = llm.runner.shape.vocab_size
        try:
            for bs in args.batch_sizes:
                run = run_bench(
                    llm, batch_size=bs, input_len=args.input_len, output_len=args.output_len, num_prompts=bs
                )
                result[f"decode_step_ms_bs{bs}"] = run["decode_step_ms_median"]
                print(f"{name:22s} bs={bs:4d} decode step {run['decode_step_ms_median']:.3f} ms", flush=True)
            if args.offline:
                n, i, o = args.offline
                run = run_bench(llm, batch_size=256, input_len=i, output_len=o, num_prompts=n)
                result["offline_output_tokens_per_s"] = run["output_tokens_per_s"]
                print(f"{name:22s} offline {n} x {i} -> {o}: {run['output_tokens_per_s']:.0f} output tok/s", flush=True)
            result.update(_invariance(llm, vocab, args.input_len, min(args.output_len, 64)))
            print(f"{name:22s} {result['same_tokens_alone_and_in_batch_of_65']=}", flush=True)
        finally:
            llm.close()
        results[name] = result
    base = results["default"]
    for name in results:
        if name == "default":
            continue
        ratios = {
            key: results[name][key] / base[key]
            for key in base
            if key.startswith("decode_step_ms") and isinstance(base[key], float)
        }
        if "offline_output_tokens_per_s" in base:
            ratios["offline_slowdown"] = (
                base["offline_output_tokens_per_s"] / results[name]["offline_output_tokens_per_s"]
            )
        results[name]["against_default"] = ratios
        print(f"{name}: " + ", ".join(f"{k} {v:.3f}x" for k, v in ratios.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
