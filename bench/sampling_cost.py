"""What sampling costs against greedy: output throughput of greedy, sampled (temperature 0.8, top-p 0.95, top-k 50)
and penalised (the same plus frequency 0.5 and repetition 1.1) decoding, in one process on one device, with the op
table's `sample`, the torch reference and (where the device compiles Triton) the portable Triton kernel, to choose
between them. With the op table's op, decode steps sample inside the decode graphs (omnirun.sampling.graph_form);
`--graph-sampling both` also times greedy and the op table's runs with the sampling eagerly after each replay
(keys ending in `_eager`), as before it moved into the graphs. Other ops always sample eagerly (the graphs hold the
op table's).

    python bench/sampling_cost.py --preset llama-3-8b --device cuda --batch-sizes 1 64 256 \
        --json bench/results/h200_sampling_cost.json
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import torch
from sample_op import op_ms  # noqa: E402 - beside this script

from omnirun.bench import run_bench
from omnirun.engine import LLM
from omnirun.kernels import offers_triton
from omnirun.sampling import SamplingBatch, SamplingParams, reference

SETTINGS = {
    "greedy": {},
    "sampled": {"temperature": 0.8, "top_p": 0.95, "top_k": 50},
    "penalised": {"temperature": 0.8, "top_p": 0.95, "top_k": 50, "frequency_penalty": 0.5, "repetition_penalty": 1.1},
}


def _op_alone_ms(llm: LLM, op, batch_size: int) -> float:
    """The sample op alone on random logits of the model's vocabulary (bench/sample_op.py times it)."""
    runner = llm.runner
    vocab = runner.shape.vocab_size
    logits = torch.randn(batch_size, vocab, device=runner.device).to(runner.dtype)
    params = [SamplingParams(**SETTINGS["sampled"])] * batch_size
    return op_ms(runner.platform, op, logits, SamplingBatch.build(params, [0] * batch_size, runner.device, vocab))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="llama-3-8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument(
        "--ops", nargs="+", default=["op_table", "reference", "triton"], help="which sample ops to time end to end"
    )
    parser.add_argument(
        "--graph-sampling",
        choices=["on", "off", "both"],
        default="both",
        help="the op table's sampling inside the decode graphs (on), eagerly after each replay (off), or both",
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    llm = LLM(
        args.preset,
        load_format="dummy",
        device=args.device,
        dtype=args.dtype,
        max_running_requests=max(args.batch_sizes),
        # Every run sends the same prompts: with the prefix cache on, the first (greedy) run would pay the prefill
        # and the others find it cached, and tok/s would compare a prefill against none.
        disable_prefix_caching=True,
    )
    print(f"warm-up {llm.warmup_s} s", flush=True)
    sampler = llm.runner.sampler
    graphs = llm.runner.graph_runner if getattr(llm.runner.graph_runner, "widths", ()) else None
    if graphs is not None:
        print(f"decode graphs sample in them (short lists {list(graphs.widths)})", flush=True)
    ops = {"op_table": sampler.sample, "reference": reference.sample}
    if offers_triton(llm.runner.capabilities):
        from omnirun.kernels.triton.sample import sample as triton_sample

        if sampler.sample is not triton_sample:  # the portable kernel, measured whether the table offers it or not
            ops["triton"] = triton_sample
    ops = {name: op for name, op in ops.items() if name in args.ops or name == "op_table"}
    start = time.perf_counter()
    results: dict[str, dict[str, float]] = {}
    try:
        for bs in args.batch_sizes:
            row: dict[str, float] = {}
            for setting, fields in SETTINGS.items():
                for op_name, op in ops.items() if fields else [("op_table", sampler.sample)]:
                    modes = [""]  # "": in the graphs where they serve it (only the op table's op), "_eager": not
                    if op_name == "op_table" and graphs is not None:
                        modes = {"on": [""], "off": ["_eager"], "both": ["", "_eager"]}[args.graph_sampling]
                    for mode in modes:
                        sampler.sample = op
                        if graphs is not None:
                            graphs.sample_in_graph = mode == ""
                        run = run_bench(
                            llm,
                            batch_size=bs,
                            input_len=args.input_len,
                            output_len=args.output_len,
                            num_prompts=bs,
                            sampling=fields,
                        )
                        key = (setting if not fields else f"{setting}_{op_name}") + mode
                        row[f"{key}_tok_s"] = run["output_tokens_per_s"]
                        row[f"{key}_step_ms"] = run["decode_step_ms_median"]
                        greedy_key = "greedy" + mode if "greedy" + mode + "_tok_s" in row else "greedy"
                        ratio = run["output_tokens_per_s"] / row.get(f"{greedy_key}_tok_s", run["output_tokens_per_s"])
                        print(
                            f"bs={bs:4d} {key:28s} {run['output_tokens_per_s']:9.0f} tok/s  step "
                            f"{run['decode_step_ms_median']:.3f} ms  {ratio:.3f}x {greedy_key}  "
                            f"(at {time.perf_counter() - start:.0f} s)",
                            flush=True,
                        )
                sampler.sample = ops["op_table"]
                if graphs is not None:
                    graphs.sample_in_graph = True
            alone = dict(ops)
            triton_op = next((op for op in ops.values() if op.__module__ == "omnirun.kernels.triton.sample"), None)
            if triton_op is not None:
                alone["triton_bisection"] = functools.partial(triton_op, pivots=2)  # against 16 pivots a pass
            for op_name, op in alone.items():
                row[f"op_{op_name}_ms"] = _op_alone_ms(llm, op, bs)
                print(f"bs={bs:4d} sample op alone ({op_name}): {row[f'op_{op_name}_ms']:.3f} ms", flush=True)
            results[f"bs{bs}"] = row
    finally:
        llm.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "args": vars(args),
                    "sample_op": ops["op_table"].__module__,
                    "warmup_s": llm.warmup_s,
                    "graph_sampling": args.graph_sampling if graphs is not None else "no graphs",
                    "results": results,
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
