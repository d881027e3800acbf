"""`python -m omnirun.conformance --device X [pytest arguments]`: run the installed conformance suite on X."""

from __future__ import annotations

import sys

import pytest


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    return int(pytest.main(["--pyargs", "omnirun.conformance", *args]))


if __name__ == "__main__":
    sys.exit(main())
