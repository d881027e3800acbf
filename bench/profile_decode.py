"""Where a decode step's time goes: torch.profiler over a few engine steps at one batch size.

    python bench/profile_decode.py --preset llama-3-8b --device cuda --batch-size 1

Prints the device kernels by total time (CUDA-graph replays included) and the host ops by self time, then times
plain steps (no profiler): wall time per step, and how much of it the host spent waiting for the device. With
overlap scheduling the host prepares the next step while the device runs this one; when the wait is near zero the
step is bound by the host's work, not the device's.
"""

from __future__ import annotations

import argparse
import time

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
    parser.add_argument("--timed-steps", type=int, default=20)
    parser.add_argument("--trace", help="also write the profiled steps as a Chrome trace (chrome://tracing) here")
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
    params = SamplingParams(temperature=0, max_new_tokens=args.steps + args.timed_steps + 20, ignore_eos=True)
    requests = [
        engine.add_request(prompt, params)
        for prompt in random_prompts(args.batch_size, args.input_len, llm.runner.shape.vocab_size, seed=0)
    ]
    # Prefill (as many chunked steps as the prompts take), then a few decode steps of the whole batch.
    while min(len(r.output_ids) for r in requests) < 3:
        engine.step()
    with torch.profiler.profile() as prof:
        for _ in range(args.steps):
            engine.step()
    if args.trace:
        prof.export_chrome_trace(args.trace)
    averages = prof.key_averages()
    print(averages.table(sort_by="device_time_total", row_limit=args.rows, max_name_column_width=60))
    print(averages.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=60))
    print(device_idle_time(prof, args.steps))
    print(host_and_device_time(engine, args.timed_steps))


def device_idle_time(prof, steps: int) -> str:
    """How long the device sat idle over the profiled steps: in short gaps between kernels (launch latency, inside
    graphs too) and in long ones (waiting for the host to queue the next work)."""
    from torch.autograd import DeviceType

    spans = sorted(
        (e.time_range.start, e.time_range.end, e.name) for e in prof.events() if e.device_type != DeviceType.CPU
    )
    if not spans:
        return "no device events recorded"
    short = long = 0.0
    short_before: dict[str, float] = {}  # the short gaps by the kernel that ends them: which launches wait
    end = spans[0][1]
    for start, stop, name in spans[1:]:
        gap = start - end
        if gap > 0:
            if gap > 50:  # microseconds
                long += gap
            else:
                short += gap
                short_before[name] = short_before.get(name, 0.0) + gap
        end = max(end, stop)
    total = (end - spans[0][0]) / 1e3
    worst = sorted(short_before.items(), key=lambda item: -item[1])[:8]
    return (
        f"device over {steps} steps: {total / steps:.3f} ms per step from first to last kernel, idle "
        f"{short / 1e3 / steps:.3f} ms in gaps <= 50 us and {long / 1e3 / steps:.3f} ms in longer ones\n"
        "short gaps per step by the kernel after them: "
        + ", ".join(f"{name[:48]} {gap / steps:.1f} us" for name, gap in worst)
    )


def host_and_device_time(engine, steps: int) -> str:
    """Wall time per step and the part spent waiting for the device's events (the step's tokens), over `steps`."""
    platform = engine.runner.platform
    make_event, waited = platform.event, [0.0]

    class TimedEvent:
        def __init__(self):
            self._event = make_event()

        def record(self):
            self._event.record()

        def synchronize(self):
            start = time.perf_counter()
            self._event.synchronize()
            waited[0] += time.perf_counter() - start

    platform.event = TimedEvent
    try:
        # Two steps before the clock: the step in flight when it starts has a timed event. No synchronisation
        # before it either: the first timed step would then find its predecessor done and wait for nothing, and the
        # mean would come out short by about a step's device time over `steps`.
        for _ in range(2):
            engine.step()
        waited[0] = 0.0
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall = time.perf_counter() - start
    finally:
        platform.event = make_event
    per_step, wait = 1e3 * wall / steps, 1e3 * waited[0] / steps
    return (
        f"{steps} steps: {per_step:.3f} ms per step, of which {wait:.3f} ms waiting for the device and "
        f"{per_step - wait:.3f} ms of host work"
    )


if __name__ == "__main__":
    main()
