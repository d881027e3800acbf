"""Start a runner on a dummy preset and time eager prefill/decode steps (a smoke check, not the benchmark)."""

from __future__ import annotations

import argparse
import logging
import time

import torch

from omnirun.batch import build_batch
from omnirun.config import RunnerConfig
from omnirun.runner import ModelRunner


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--profile", action="store_true", help="print the top ops of three decode steps")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    start = time.perf_counter()
    runner = ModelRunner(RunnerConfig(model=args.model, device=args.device, load_format="dummy", dtype="bfloat16"))
    print(f"start-up {time.perf_counter() - start:.1f} s: {runner.describe()}")
    rows = [runner.kv.new_request() for _ in range(args.batch_size)]
    prompts = [[(7 * i + j) % 1000 for j in range(args.input_len)] for i in range(args.batch_size)]
    runner.platform.synchronize()
    t = time.perf_counter()
    logits = runner.forward(build_batch(runner.kv, rows, [0] * len(rows), prompts, runner.device))
    runner.platform.synchronize()
    print(f"prefill {1e3 * (time.perf_counter() - t):.1f} ms")
    lens = [args.input_len] * len(rows)
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        tokens = logits.argmax(-1).tolist()
        logits = runner.forward(build_batch(runner.kv, rows, lens, [[x] for x in tokens], runner.device))
        runner.platform.synchronize()
        times.append(time.perf_counter() - t)
        lens = [n + 1 for n in lens]
    times.sort()
    print(f"decode bs={args.batch_size}: median {1e3 * times[len(times) // 2]:.2f} ms/step")
    if args.profile:
        with torch.profiler.profile() as prof:
            for _ in range(3):
                tokens = logits.argmax(-1).tolist()
                logits = runner.forward(build_batch(runner.kv, rows, lens, [[x] for x in tokens], runner.device))
                lens = [n + 1 for n in lens]
            runner.platform.synchronize()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=12))


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
