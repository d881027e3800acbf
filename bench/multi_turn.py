"""Multi-turn chat with and without the prefix cache: each turn resends the whole conversation so far.

    python bench/multi_turn.py --preset llama-3-8b --device cuda --conversations 64 --turns 6 \
        --system-len 512 --user-len 128 --output-len 128 --json bench/results/h200_multi_turn.json

Every conversation starts from its own system prompt; each turn appends `--user-len` new random tokens to the
history (system prompt, earlier user turns and the model's answers) and generates `--output-len` tokens; all
conversations send turn t together. Prints, for each turn and both settings, the mean and p90 time to first token
and the prompt tokens the turn computed and found cached.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics

from omnirun.engine import LLM
from omnirun.sampling import SamplingParams


def run_turns(llm: LLM, args: argparse.Namespace) -> list[dict[str, float]]:
    rng = random.Random(args.seed)
    vocab = llm.runner.shape.vocab_size
    histories = [[rng.randrange(vocab) for _ in range(args.system_len)] for _ in range(args.conversations)]
    params = SamplingParams(temperature=0, max_new_tokens=args.output_len, ignore_eos=True)
    engine = llm.engine
    turns = []
    for turn in range(args.turns):
        prompts = [history + [rng.randrange(vocab) for _ in range(args.user_len)] for history in histories]
        before = engine.prefill_stats()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        after = engine.prefill_stats()
        ttfts = sorted(1e3 * o.ttft_s for o in outputs)
        turns.append(
            {
                "turn": turn + 1,
                "prompt_len_mean": statistics.fmean(len(p) for p in prompts),
                "ttft_ms_mean": statistics.fmean(ttfts),
                "ttft_ms_p90": ttfts[int(0.9 * (len(ttfts) - 1))],
                "prompt_tokens_computed": after.computed_tokens - before.computed_tokens,
                "prompt_tokens_cached": after.cached_tokens - before.cached_tokens,
            }
        )
        histories = [p + list(o.token_ids) for p, o in zip(prompts, outputs, strict=True)]
    return turns


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen2.5-0.5b")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--conversations", type=int, default=64)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--system-len", type=int, default=512)
    parser.add_argument("--user-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    results = {}
    for cache in ("on", "off"):
        with LLM(
            args.preset,
            load_format="dummy",
            device=args.device,
            dtype=args.dtype,
            max_running_requests=args.conversations,
            disable_prefix_caching=cache == "off",
            progress=False,
        ) as llm:
            llm.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2), use_tqdm=False)  # warm up
            results[cache] = run_turns(llm, args)
        for t in results[cache]:
            print(
                f"cache {cache:3s} turn {t['turn']} prompt {t['prompt_len_mean']:7.0f} tokens | TTFT mean "
                f"{t['ttft_ms_mean']:8.1f} ms p90 {t['ttft_ms_p90']:8.1f} ms | computed "
                f"{t['prompt_tokens_computed']:7d} cached {t['prompt_tokens_cached']:7d}",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
