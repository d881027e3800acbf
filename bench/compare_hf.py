"""omnirun against HF transformers `generate`, side by side in one process: same shapes, device and dtype.

    python bench/compare_hf.py --preset qwen2.5-0.5b --device cpu --batch-sizes 1 8 32 --input-len 32 --output-len 64

Both run greedy on random prompts with EOS ignored, from dummy weights of the preset's shape. Prints output
tokens/s and decode ms/step for each batch size, the ratio omnirun/HF, and omnirun's roofline fraction; `--json`
writes everything.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from omnirun.bench import random_prompts, run_bench
from omnirun.engine import LLM
from omnirun.loader import preset_config


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
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--attention-backend", default=None)
    parser.add_argument("--disable-graph", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_grad_enabled(False)

    llm = LLM(
        args.preset,
        load_format="dummy",
        device=args.device,
        dtype=args.dtype,
        max_running_requests=max(args.batch_sizes),
        attention_backend=args.attention_backend,
        disable_graph=args.disable_graph,
        progress=False,
    )
    platform, dtype = llm.runner.platform, llm.runner.dtype
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_config(preset_config(args.preset), dtype=dtype).to(llm.runner.device).eval()
    vocab = llm.runner.shape.vocab_size

    rows = []
    for bs in args.batch_sizes:
        hf_result = hf_generate_timing(
            hf, random_prompts(bs, args.input_len, vocab, seed=bs), args.output_len, platform.synchronize
        )
        ours = run_bench(llm, batch_size=bs, input_len=args.input_len, output_len=args.output_len, num_prompts=bs)
        ratio = ours["output_tokens_per_s"] / hf_result["output_tokens_per_s"]
        rows.append({"batch_size": bs, "hf": hf_result, "omnirun": ours, "ratio": ratio})
        print(
            f"bs={bs:4d}  HF {hf_result['output_tokens_per_s']:9.1f} tok/s {hf_result['decode_step_ms']:8.2f} ms/step"
            f" | omnirun {ours['output_tokens_per_s']:9.1f} tok/s {ours['decode_step_ms_median']:8.2f} ms/step"
            f" | ratio {ratio:5.2f}x | omnirun roofline {ours['roofline_fraction_copy_bw']:.1%} of "
            f"{ours['copy_GBps']:.1f} GB/s copy, {ours['roofline_fraction_read_bw']:.1%} of "
            f"{ours['read_GBps']:.1f} GB/s read",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": rows}, f, indent=2)


if __name__ == "__main__":
    main()
