"""The calibration for a decode step: the same step's matmuls alone, plain torch (cuBLAS on NVIDIA), in a graph.

    python bench/matmul_only.py --preset llama-3-8b --device cuda --batch-sizes 1 128 256

Per layer the fused q|k|v projection, o_proj, the fused gate|up projection and down_proj, then the LM head, each
weight its own tensor (so no layer finds its weights in cache) in the model dtype, F.linear as the model calls it.
Nothing else runs: no norms, rotary, KV store, attention, sampling or host work. A decode step can approach this
figure; `bench/compare_hf.py --matmul-only` prints the ratio of omnirun's step to it in the same run.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from omnirun.loader import preset_config
from omnirun.models.architecture import DecoderShape, decoder_shape
from omnirun.registry import get_platform


def matmul_weights(shape: DecoderShape, dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """[out, in] weights of one decode step, in execution order."""
    h, d = shape.hidden_size, shape.head_dim
    qkv = (shape.num_heads + 2 * shape.num_kv_heads) * d
    per_layer = [(qkv, h), (h, shape.num_heads * d), (2 * shape.intermediate_size, h), (h, shape.intermediate_size)]
    sizes = per_layer * shape.num_layers + [(shape.vocab_size, h)]
    return [torch.empty(o, i, dtype=dtype, device=device).normal_(std=0.02) for o, i in sizes]


def matmul_only_step_ms(platform, shape: DecoderShape, batch_size: int, dtype: torch.dtype, replays: int = 50) -> float:
    """Median ms of one replay of a graph holding the step's matmuls at `batch_size` rows (eager if the platform
    captures no graphs)."""
    device = platform.device()
    weights = matmul_weights(shape, dtype, device)
    x = torch.randn(batch_size, shape.hidden_size, dtype=dtype, device=device)
    mid = torch.randn(batch_size, shape.intermediate_size, dtype=dtype, device=device)

    def step() -> None:
        for i, w in enumerate(weights):
            # down_proj (every 4th in a layer) reads the activation's width; every other matmul the hidden width.
            F.linear(mid if i % 4 == 3 and i < len(weights) - 1 else x, w)

    with torch.inference_mode():
        for _ in range(3):
            step()
        api = platform.graph_api()
        run = step
        if api is not None:
            graph = api.new_graph()
            with api.capture(graph, pool=api.new_pool()):
                step()
            run = graph.replay
        times = []
        for _ in range(replays):
            start, end = platform.event(enable_timing=True), platform.event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    weights.clear()  # (the graph keeps none alive: its memory goes with it)
    platform.empty_cache()
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="llama-3-8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 128, 256])
    args = parser.parse_args()
    platform = get_platform(args.device)
    shape = decoder_shape(preset_config(args.preset))
    for bs in args.batch_sizes:
        ms = matmul_only_step_ms(platform, shape, bs, getattr(torch, args.dtype))
        print(f"bs={bs:4d} matmul-only step {ms:7.3f} ms", flush=True)


if __name__ == "__main__":
    main()
