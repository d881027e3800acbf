"""`omnirun <command> --help` explains every flag: each has a help text, and each that takes a value names its
default there."""

from __future__ import annotations

import argparse

import pytest

from omnirun.cli import build_parser, main

# Flags whose help text lives in files of other owners and does not yet say it all (common/server/cli.py,
# common/bench_serve.py). Drop an entry once its flag is explained: the test then checks it like the others.
KNOWN_GAPS = {
    ("serve", "--port"),
    ("serve", "--api-key"),
    ("serve", "--log-level"),
    ("bench serve", "--api-key"),
    ("bench serve", "--num-prompts"),
    ("bench serve", "--input-len"),
    ("bench serve", "--output-len"),
    ("bench serve", "--vocab-size"),
    ("bench serve", "--request-rate"),
    ("bench serve", "--max-concurrency"),
    ("bench serve", "--seed"),
    ("bench serve", "--json"),
}


def _commands(parser: argparse.ArgumentParser, prefix: str = "") -> dict[str, argparse.ArgumentParser]:
    """Every (sub)command's parser by its name as typed ("bench serve")."""
    found = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found[f"{prefix}{name}"] = sub
                found.update(_commands(sub, f"{prefix}{name} "))
    return found


def _unexplained(command: str, parser: argparse.ArgumentParser) -> set[tuple[str, str]]:
    gaps = set()
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        text = action.help or ""
        takes_value = action.nargs != 0  # store_true flags are off unless given
        if not text.strip() or (takes_value and "default" not in text):
            gaps.add((command, action.option_strings[0]))
    return gaps


COMMANDS = _commands(build_parser())


def test_the_commands_are_all_there():
    assert {"env", "generate", "bench", "serve", "bench serve"} <= set(COMMANDS)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_flag_has_help_naming_its_default(command):
    gaps = _unexplained(command, COMMANDS[command])
    known = {gap for gap in KNOWN_GAPS if gap[0] == command}
    assert gaps == known, f"flags without help or without their default: {sorted(gaps - known)}; explained now: " + (
        f"{sorted(known - gaps)}"
    )


@pytest.mark.parametrize("command", ["generate", "bench", "serve"])
@pytest.mark.parametrize("flag", ["--dtype", "--load-format", "--page-size", "--max-total-tokens", "--context-length"])
def test_runner_flags_render_their_default(command, flag):
    parser = COMMANDS[command]
    action = next(a for a in parser._actions if flag in a.option_strings)
    text = parser._get_formatter()._expand_help(action)  # what --help prints, %(default)s filled in
    assert "(default: " in text and "%(" not in text, text


def test_generate_help_shows_the_sampling_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps help to the terminal's width
    for shown in ("0 is greedy (default: 0.0)", "(default: 1.0, off)", "-1 or 0 is off (default: -1)", "(default: 32)"):
        assert shown in text
