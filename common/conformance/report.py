"""The conformance certificate: `python -m omnirun.conformance --device X --report report.json` (or pytest's
`--conformance-report report.json`) writes what a vendor publishes and what our lanes archive: the contract
version, omnirun's, torch's and the vendor packages' versions, the device, every test with its outcome, and what a
default run builds there (`omnirun.assembly`). Its `platform` entry is `omnirun env --json`'s for that device."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import pytest


class ConformanceReport:
    """A pytest plugin object: collects each test's outcome and writes the report when the session ends."""

    def __init__(self, path: str, device: str):
        self.path = Path(path)
        self.device = device
        self.tests: dict[str, dict[str, Any]] = {}
        self.started = time.time()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        # A test's outcome is its call's, unless its setup or teardown failed or it was skipped at setup.
        entry = self.tests.setdefault(report.nodeid, {"test": report.nodeid, "outcome": "passed", "duration_s": 0.0})
        entry["duration_s"] = round(entry["duration_s"] + report.duration, 3)
        if report.skipped:
            entry["outcome"] = "skipped"
            entry["reason"] = _skip_reason(report)
        elif report.failed:
            entry["outcome"] = "failed" if report.when == "call" else "error"
            entry["reason"] = _failure(report)

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        counts: dict[str, int] = {}
        for entry in self.tests.values():
            counts[entry["outcome"]] = counts.get(entry["outcome"], 0) + 1
        report = {
            **platform_facts(self.device),
            "summary": {**counts, "exit_status": int(exitstatus), "seconds": round(time.time() - self.started, 1)},
            "tests": list(self.tests.values()),
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(report, indent=2) + "\n")


def _failure(report: pytest.TestReport) -> str:
    """The exception's line ("AssertionError: ...", "RuntimeError: ..."), as pytest's summary shows it."""
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else report.longreprtext
    return text.strip().splitlines()[0] if text.strip() else ""


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # (file, line, "Skipped: reason")
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def platform_facts(device: str) -> dict[str, Any]:
    """Versions, the contract, the platform as `omnirun env --json` reports it, and what a default run builds."""
    from omnirun.env_report import header, platform_row
    from omnirun.facts import PLATFORM_API_VERSION
    from omnirun.registry import default_registry

    platform = default_registry().platforms.get(device)
    facts: dict[str, Any] = {
        **header(),
        "device": device,
        "contract": {"omnirun": PLATFORM_API_VERSION, "platform": getattr(platform, "api_version", None)},
    }
    if platform is None:
        facts["platform"] = None
        return facts
    row = platform_row(platform)
    facts["platform"] = dataclasses.asdict(row)
    facts["default_run"] = row.default_run
    return facts
