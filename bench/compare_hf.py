"""omnirun against HF transformers `generate`, side by side in one process: same shapes, device and dtype.

    python bench/compare_hf.py --preset qwen2.5-0.5b --device cpu --batch-sizes 1 8 32 --input-len 32 --output-len 64
    python bench/compare_hf.py --preset llama-3-8b --device cuda --batch-sizes 1 8 32 64 128 256 --hf-batch-sizes 1 32 \
        --input-len 128 --output-len 128 --offline 256 256 256

Both run greedy on random prompts with EOS ignored, from random weights of the preset's shape. For each batch size
it prints output tokens/s and decode ms/step of both, the ratio omnirun/HF, and omnirun's roofline fraction;
`--offline N I O` also runs N prompts of I tokens, O new tokens each, through omnirun (HF's figure for that work
is quoted from the issue, not rerun: it takes minutes). `--matmul-only` first measures each batch size's step with
its matmuls alone (bench/matmul_only.py) and prints omnirun's step as a multiple of it. `--json` writes everything.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from omnirun.bench import random_prompts, run_bench
from omnirun.engine import LLM
from omnirun.loader import preset_config
from omnirun.models.architecture import decoder_shape
from omnirun.registry import get_platform


def hf_generate_timing(model, prompts: list[list[int]], output_len: int, sync) -> dict[str, float]:
    device = next(model.parameters()).device
    ids = torch.tensor(prompts, device=device)
    kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=False, eos_token_id=None, pad_token_id=0)

    def timed(new_tokens: int) -> float:
        sync()
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
        sync()
        assert out.shape[1] == ids.shape[1] + new_tokens
        return time.perf_counter() - start

    timed(2)  # warm up
    ttft = timed(1)
    total = timed(output_len)
    return {
        "output_tokens_per_s": len(prompts) * output_len / total,
        "decode_step_ms": 1e3 * (total - ttft) / (output_len - 1),
        "ttft_ms": 1e3 * ttft,
        "total_s": total,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen2.5-0.5b")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--hf-batch-sizes", type=int, nargs="*", default=None, help="default: all batch sizes")
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--offline", type=int, nargs=3, metavar=("N", "IN", "OUT"), default=None)
    parser.add_argument("--attention-backend", default=None)
    parser.add_argument("--disable-graph", action="store_true")
    parser.add_argument("--mem-fraction-static", type=float, default=None)
    parser.add_argument("--matmul-only", action="store_true", help="calibrate against the step's matmuls alone")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    hf_sizes = args.batch_sizes if args.hf_batch_sizes is None else args.hf_batch_sizes

    matmul_ms = {}
    if args.matmul_only:
        from matmul_only import matmul_only_step_ms  # bench/, next to this script

        # Measured before anything else holds device memory; the weights are freed after each size.
        shape, platform = decoder_shape(preset_config(args.preset)), get_platform(args.device)
        for bs in args.batch_sizes:
            matmul_ms[bs] = matmul_only_step_ms(platform, shape, bs, getattr(torch, args.dtype))
            print(f"bs={bs:4d} | matmul-only step {matmul_ms[bs]:.3f} ms", flush=True)

    hf = None
    if hf_sizes:
        from transformers import AutoModelForCausalLM

        # Built first and on the device (random init there is fast), before omnirun sizes its KV pool.
        with torch.device(args.device):
            hf = AutoModelForCausalLM.from_config(preset_config(args.preset), dtype=getattr(torch, args.dtype))
        hf.eval()

    max_bs = max(args.batch_sizes + ([args.offline[0]] if args.offline else []))
    start = time.perf_counter()
    llm = LLM(
        args.preset,
        load_format="dummy",
        device=args.device,
        dtype=args.dtype,
        max_running_requests=max_bs,
        attention_backend=args.attention_backend,
        disable_graph=args.disable_graph or None,
        mem_fraction_static=args.mem_fraction_static,
    )
    startup_s = time.perf_counter() - start
    print(f"omnirun start-up (dummy weights + KV sizing + graph capture): {startup_s:.1f} s  {llm.runner.describe()}")
    platform, vocab = llm.runner.platform, llm.runner.shape.vocab_size

    rows = []
    for bs in args.batch_sizes:
        row = {"batch_size": bs}
        ours = run_bench(llm, batch_size=bs, input_len=args.input_len, output_len=args.output_len, num_prompts=bs)
        row["omnirun"] = ours
        line = (
            f"bs={bs:4d} | omnirun {ours['output_tokens_per_s']:9.1f} tok/s {ours['decode_step_ms_median']:8.2f} "
            f"ms/step, roofline {ours['roofline_fraction_copy_bw']:.1%} of {ours['copy_GBps']:.0f} GB/s copy "
            f"({ours['roofline_fraction_read_bw']:.1%} of {ours['read_GBps']:.0f} GB/s read)"
        )
        if bs in matmul_ms:
            row["matmul_only_step_ms"] = matmul_ms[bs]
            row["step_over_matmul_only"] = ours["decode_step_ms_median"] / matmul_ms[bs]
            line += f" | {row['step_over_matmul_only']:.3f}x matmul-only ({matmul_ms[bs]:.2f} ms)"
        if bs in hf_sizes:
            prompts = random_prompts(bs, args.input_len, vocab, seed=bs)
            hf_result = hf_generate_timing(hf, prompts, args.output_len, platform.synchronize)
            row["hf"] = hf_result
            row["ratio"] = ours["output_tokens_per_s"] / hf_result["output_tokens_per_s"]
            line += (
                f" | HF {hf_result['output_tokens_per_s']:9.1f} tok/s {hf_result['decode_step_ms']:8.2f} ms/step"
                f" | ratio {row['ratio']:5.2f}x"
            )
        rows.append(row)
        print(line, flush=True)

    offline = None
    if args.offline:
        n, input_len, output_len = args.offline
        offline = run_bench(llm, batch_size=n, input_len=input_len, output_len=output_len, num_prompts=n, warmup=False)
        print(
            f"offline: {n} prompts x {input_len} tokens -> {output_len} new: "
            f"{offline['output_tokens_per_s']:.1f} output tok/s in {offline['total_s']:.1f} s",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "startup_s": startup_s, "results": rows, "offline": offline}, f, indent=2)


if __name__ == "__main__":
    main()
