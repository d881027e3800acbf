"""Is a torch.compile'd decode step faster than eager on the CPU? The measurement behind the cpu platform's choice
of graph runner (issue 16): the same engine, the same requests, decode steps timed eager and then with the runner's
model call (`ModelRunner.run_model`, what a device graph captures) through torch.compile.

    python bench/cpu_compile.py --preset qwen2.5-0.5b --batch-sizes 1 8 --json bench/results/cpu_compile.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from omnirun.bench import random_prompts
from omnirun.engine import LLM
from omnirun.sampling import SamplingParams


def step_times(engine, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times


def keep_packed_matmuls_eager() -> None:
    """Inductor cannot lower oneDNN's packed linear (mkldnn._linear_pointwise) with dynamic shapes (torch 2.13:
    LoweringException): the compiled step runs those matmuls as eager calls and compiles everything around them."""
    from omnirun.devices.cpu import packed_linear

    packed_linear.linear = torch.compiler.disable(packed_linear.linear)


def measure(preset: str, batch_size: int, input_len: int, steps: int, compile_mode: str | None) -> dict:
    llm = LLM(preset, load_format="dummy", dtype="bfloat16", device="cpu", max_running_requests=batch_size)
    try:
        engine, runner = llm.engine, llm.runner
        if compile_mode is not None:
            runner.run_model = torch.compile(runner.run_model, mode=compile_mode, dynamic=True)
        params = SamplingParams(temperature=0, max_new_tokens=3 * steps + 20, ignore_eos=True)
        for prompt in random_prompts(batch_size, input_len, runner.shape.vocab_size, seed=0):
            engine.add_request(prompt, params)
        start = time.perf_counter()
        warm = step_times(engine, 8)  # prefill, then decode steps (the first compiled ones compile)
        warm_s = time.perf_counter() - start
        times = step_times(engine, steps)
        return {
            "batch_size": batch_size,
            "compile": compile_mode or "eager",
            "decode_step_ms_median": 1e3 * statistics.median(times),
            "decode_step_ms_min": 1e3 * min(times),
            "warmup_s": warm_s,
            "first_decode_step_s": warm[-7],
        }
    finally:
        llm.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen2.5-0.5b")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--mode", default="default", help="torch.compile mode (default, max-autotune-no-cudagraphs)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    results = []
    keep_packed_matmuls_eager()
    for batch_size in args.batch_sizes:
        for mode in (None, args.mode):
            row = measure(args.preset, batch_size, args.input_len, args.steps, mode)
            print(
                f"bs={batch_size:4d} | {row['compile']:>8}: {row['decode_step_ms_median']:8.2f} ms/step median "
                f"(min {row['decode_step_ms_min']:.2f}), warm-up {row['warmup_s']:.1f} s",
                flush=True,
            )
            results.append(row)
    for eager, compiled in zip(results[::2], results[1::2], strict=True):
        ratio = compiled["decode_step_ms_median"] / eager["decode_step_ms_median"]
        print(f"bs={eager['batch_size']:4d} | compiled / eager step: {ratio:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "torch": torch.__version__, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
