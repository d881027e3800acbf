"""The `omnirun` command line."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import TYPE_CHECKING

from omnirun.errors import OmnirunError
from omnirun.registry import DEVICE_ENV_VAR

if TYPE_CHECKING:
    from omnirun.platform import Platform


def _add_device_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device",
        default=None,
        help=f"cuda | rocm | npu | xpu | cpu | auto | <plugin> (default: ${DEVICE_ENV_VAR}, else auto)",
    )


def _cmd_env(args: argparse.Namespace) -> int:
    from omnirun.env_report import collect, to_json, to_table
    from omnirun.registry import default_registry

    registry = default_registry()
    if not (args.device or os.environ.get(DEVICE_ENV_VAR)):
        # Plain `omnirun env` reports everything, broken plugins included; say what auto would pick if it can.
        try:
            selected = registry.select("auto").name
        except OmnirunError:
            selected = None
        rows = collect(registry)
    else:
        selected = registry.select(args.device).name  # unusable device: one-line error, non-zero exit
        rows = collect(registry, only=selected)
    print(to_json(rows, selected) if args.json else to_table(rows, selected))
    return 0


def _sampling_params(args: argparse.Namespace):
    """The request's SamplingParams from generate's flags (checked before the model loads)."""
    from omnirun.sampling import SamplingParams

    return SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.sampling_seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )


def _model_and_device(args: argparse.Namespace) -> tuple[str, Platform]:
    """The model to load and the Platform of --device (or $OMNIRUN_DEVICE, or auto), resolved once here: an
    unusable device fails before anything loads."""
    from omnirun.registry import select_platform

    platform = select_platform(args.device)
    if args.model is None:
        from omnirun.assets.default_model import default_model_dir

        return default_model_dir(), platform
    from omnirun.loader import load_model_config

    # A missing model directory (or config.json) is the first thing to say, before what it lacks (a tokenizer).
    load_model_config(args.model, args.load_format or "auto")
    return args.model, platform


def _cmd_generate(args: argparse.Namespace) -> int:
    from omnirun.cli_flags import llm_kwargs
    from omnirun.engine import LLM
    from omnirun.engine.tokenizer import tokenizer_dir

    prompts = args.prompt or ["Hello"]
    if args.stream and len(prompts) > 1:
        raise OmnirunError(
            f"--stream prints one prompt as it is generated, got {len(prompts)} prompts: give one --prompt"
        )
    params = _sampling_params(args)
    model, platform = _model_and_device(args)
    if tokenizer_dir(args.tokenizer, model) is None:
        raise OmnirunError(f"{model} has no tokenizer for text prompts: pass --tokenizer <HF tokenizer dir>")
    with LLM(model, **{**llm_kwargs(args), "device": platform}) as llm:
        if args.stream:
            for delta in llm.stream(prompts[0], params):
                print(delta.text, end="", flush=True)
            print()
            return 0
        for i, output in enumerate(llm.generate(prompts, params, use_tqdm=False)):
            if len(prompts) > 1:
                print(f"--- [{i}] {output.finish_reason}, {len(output.token_ids)} tokens")
            print(output.text)
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from omnirun.bench import format_result, run_bench
    from omnirun.cli_flags import llm_kwargs
    from omnirun.engine import LLM

    for flag in ("batch_size", "input_len", "output_len", "num_prompts"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise OmnirunError(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    if args.shared_prefix_len < 0:
        raise OmnirunError(f"--shared-prefix-len must be >= 0, got {args.shared_prefix_len}")
    if args.json and not Path(args.json).resolve().parent.is_dir():
        raise OmnirunError(f"--json {args.json}: its folder does not exist; create it or name another file")
    model, platform = _model_and_device(args)
    kwargs = {**llm_kwargs(args), "device": platform}
    kwargs.setdefault("max_running_requests", args.batch_size)
    with LLM(model, **kwargs) as llm:
        result = run_bench(
            llm,
            batch_size=args.batch_size,
            input_len=args.input_len,
            output_len=args.output_len,
            num_prompts=args.num_prompts or args.batch_size,
            seed=args.seed or 0,
            shared_prefix_len=args.shared_prefix_len,
        )
    print(format_result(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.json}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omnirun", description="One LLM model runner, many accelerators.")
    parser.add_argument("--version", action="version", version=f"omnirun {_version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    env = commands.add_parser("env", help="show every known platform: available or why not, memory, backends")
    _add_device_flag(env)
    env.add_argument("--json", action="store_true", help="print JSON instead of the text report")
    env.set_defaults(func=_cmd_env)

    from omnirun.cli_flags import add_runner_flags

    generate = commands.add_parser("generate", help="generate text for prompts (the embedded model by default)")
    add_runner_flags(generate)
    generate.add_argument("--prompt", action="append", help="a prompt (repeat for several; default: Hello)")
    generate.add_argument(
        "--max-new-tokens", type=int, default=32, help="new tokens at most per prompt (default: %(default)s)"
    )
    generate.add_argument(
        "--temperature", type=float, default=0.0, help="sampling temperature; 0 is greedy (default: %(default)s)"
    )
    generate.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="sample from the smallest set of tokens of this total probability (default: %(default)s, off)",
    )
    generate.add_argument(
        "--top-k",
        type=int,
        default=-1,
        help="sample from the k likeliest tokens; -1 or 0 is off (default: %(default)s)",
    )
    generate.add_argument(
        "--min-p",
        type=float,
        default=0.0,
        help="drop tokens below this share of the likeliest one's probability (default: %(default)s, off)",
    )
    generate.add_argument(
        "--sampling-seed",
        type=int,
        default=None,
        help="seed of this request's sampling (default: none, the generator --seed seeds)",
    )
    generate.add_argument("--stop", action="append", default=None, help="stop string, repeatable (default: none)")
    generate.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS up to --max-new-tokens")
    generate.add_argument("--stream", action="store_true", help="print the tokens as they come (one --prompt only)")
    generate.set_defaults(func=_cmd_generate)

    bench = commands.add_parser("bench", help="offline throughput and latency, with the roofline fraction")
    add_runner_flags(bench)
    bench.add_argument("--batch-size", type=int, default=1, help="requests run at once (default: %(default)s)")
    bench.add_argument("--input-len", type=int, default=128, help="random tokens per prompt (default: %(default)s)")
    bench.add_argument(
        "--output-len", type=int, default=128, help="new tokens per prompt, EOS ignored (default: %(default)s)"
    )
    bench.add_argument("--num-prompts", type=int, default=None, help="prompts in all (default: the batch size)")
    bench.add_argument(
        "--shared-prefix-len",
        type=int,
        default=0,
        help="tokens every prompt starts with, as a system prompt (default: %(default)s)",
    )
    bench.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON (default: no)")
    bench.set_defaults(func=_cmd_bench)

    from omnirun.bench_serve import add_bench_serve_parser
    from omnirun.server.cli import add_serve_parser

    add_bench_serve_parser(bench)
    add_serve_parser(commands)
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("omnirun")
    except PackageNotFoundError:  # run from a source tree that was never installed
        from omnirun import __version__

        return __version__


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="omnirun: %(levelname)s: %(message)s")
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except OmnirunError as exc:
        print(f"omnirun: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
