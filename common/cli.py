"""The `omnirun` command line."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from omnirun.errors import OmnirunError
from omnirun.registry import DEVICE_ENV_VAR


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omnirun", description="One LLM model runner, many accelerators.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    env = commands.add_parser("env", help="show every known platform: available or why not, memory, backends")
    _add_device_flag(env)
    env.add_argument("--json", action="store_true", help="print JSON instead of a table")
    env.set_defaults(func=_cmd_env)
    return parser


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
