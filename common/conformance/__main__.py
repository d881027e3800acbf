"""`python -m omnirun.conformance --device X [--report report.json] [pytest arguments]`: run the installed
conformance suite on X; `--report` writes the certificate (omnirun.conformance.report)."""

from __future__ import annotations

import argparse
import sys

import pytest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--report", default=None)
    known, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    report = ["--conformance-report", known.report] if known.report else []
    return int(pytest.main(["--pyargs", "omnirun.conformance", *report, *rest]))


if __name__ == "__main__":
    sys.exit(main())
