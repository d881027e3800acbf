"""Where a decode step's time goes: torch.profiler over a few engine steps at one batch size.

    python bench/profile_decode.py --preset llama-3-8b --device cuda --batch-size 1

Prints the device kernels by total time (CUDA-graph replays included) and the host ops by self time.
"""

from __future__ import annotations

import argparse

import torch

from omnirun.bench import random_prompts
from omnirun.engine import LLM
from omnirun.sampling import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen2.5-0.5b")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rows", type=int, default=20)
    args = parser.parse_args()
    llm = LLM(
        args.preset,
        load_format="dummy",
        dtype="bfloat16",
        device=args.device,
        max_running_requests=args.batch_size,
        progress=False,
    )
    engine = llm.engine
    params = SamplingParams(temperature=0, max_new_tokens=10 * args.steps + 10, ignore_eos=True)
    for prompt in random_prompts(args.batch_size, args.input_len, llm.runner.shape.vocab_size, seed=0):
        engine.add_request(prompt, params)
    for _ in range(5):  # prefill, then warm decode steps
        engine.step()
    with torch.profiler.profile() as prof:
        for _ in range(args.steps):
            engine.step()
    averages = prof.key_averages()
    print(averages.table(sort_by="device_time_total", row_limit=args.rows, max_name_column_width=60))
    print(averages.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=60))


if __name__ == "__main__":
    main()
