"""The mutation score from `mutmut results --all true` (lines "<mutant name>: <status>"), per module and in all.

Killed: a test failed, timed out or crashed on the mutant. Every other status (survived, no tests) counts against
the score; "not checked" means the run was cut short and is reported separately.
"""

from __future__ import annotations

import collections
import re
import sys

KILLED = {"killed", "timeout", "segfault"}


def module_of(mutant: str) -> str:
    # omnirun.memory.sizing.x_plan_kv_pool__mutmut_3 / omnirun.weights.xǁClassǁmethod__mutmut_1 -> the module
    return re.sub(r"\.x[_ǁ].*$", "", mutant)


def main(path: str) -> int:
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for line in open(path, encoding="utf-8"):
        name, sep, status = line.strip().rpartition(": ")
        if sep and "__mutmut_" in name:
            counts[module_of(name)][status] += 1
    total = collections.Counter()
    print(f"{'module':40} {'killed':>7} {'of':>5} {'score':>7}  other")
    for module in sorted(counts):
        c = counts[module]
        total.update(c)
        _row(module, c)
    _row("all", total)
    return 0


def _row(label: str, c: collections.Counter) -> None:
    checked = sum(n for status, n in c.items() if status != "not checked")
    killed = sum(c[s] for s in KILLED)
    others = ", ".join(f"{n} {s}" for s, n in sorted(c.items()) if s not in KILLED)
    score = f"{killed / checked:7.1%}" if checked else "      -"
    print(f"{label:40} {killed:7} {checked:5} {score}  {others}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
