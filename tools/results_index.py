"""Write bench/results/INDEX.md: for every result file, the commit that added it (with its subject) and the settings
the file records of the run that made it (its `args`, or the bench fields that name a run), so that a number in
README or docs/performance.md can be traced to a command and a commit.

    python tools/results_index.py          # rewrites bench/results/INDEX.md
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
# Fields of an `omnirun bench` / `omnirun bench serve` JSON that say which run it was.
RUN_FIELDS = ("device", "model", "batch_size", "num_prompts", "input_len", "output_len", "request_rate", "attention")


def _added_by(path: Path) -> tuple[str, str]:
    """(short hash, subject) of the commit that added `path`, following exact renames only (result files of
    similar content are not one file); ("-", "not committed") if none."""
    out = subprocess.run(
        ["git", "log", "--follow", "-M100%", "--diff-filter=A", "--format=%h %s", "--", str(path.relative_to(ROOT))],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    if not out:
        return "-", "not committed"
    commit, _, subject = out.splitlines()[-1].partition(" ")
    return commit, subject


def _settings(path: Path) -> str:
    """The run's settings as the file records them, or '' where it records none (text logs)."""
    if path.suffix != ".json":
        return ""
    try:
        data = json.loads(path.read_text())
    except ValueError:
        return ""
    if not isinstance(data, dict):
        return ""
    if isinstance(data.get("args"), dict):
        args = {k: v for k, v in data["args"].items() if v not in (None, False) and k != "json"}
        return " ".join(f"--{k.replace('_', '-')} {_value(v)}" for k, v in args.items())
    fields = {k: data[k] for k in RUN_FIELDS if k in data}
    return ", ".join(f"{k} {_value(v)}" for k, v in fields.items())


def _value(v: object) -> str:
    if isinstance(v, list):
        return " ".join(map(str, v))
    return "" if v is True else str(v)


def main() -> None:
    lines = [
        "# Result files",
        "",
        "Made by `python tools/results_index.py`: each file, the commit that added it, and the settings it records",
        "(a script's `--args` where it saved them). The command lines themselves are in README.md and",
        "docs/performance.md next to the numbers they produced.",
        "",
        "| file | added in | settings recorded |",
        "|---|---|---|",
    ]
    for path in sorted(RESULTS.iterdir()):
        if path.name == "INDEX.md":
            continue
        commit, subject = _added_by(path)
        subject = subject if len(subject) <= 90 else subject[:87] + "..."
        settings = _settings(path).replace("|", "/")
        lines.append(f"| `{path.name}` | {commit}: {subject.replace('|', '/')} | {settings} |")
    (RESULTS / "INDEX.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
