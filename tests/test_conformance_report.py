"""The conformance certificate: `--conformance-report` (`python -m omnirun.conformance --report`) writes every
test's outcome with the versions, the contract and the platform as `omnirun env --json` reports it."""

from __future__ import annotations

import json
import subprocess
import sys

SUITE = """
import pytest

def test_passes():
    pass

def test_fails():
    assert 1 == 2, "one is not two"

@pytest.mark.skip(reason="not on this device")
def test_skipped():
    pass

@pytest.fixture
def broken():
    raise RuntimeError("setup broke")

def test_errors(broken):
    pass
"""


def test_the_report_holds_every_outcome_and_the_platform_env_reports(tmp_path):
    (tmp_path / "test_suite.py").write_text(SUITE)
    report = tmp_path / "out" / "report.json"
    run = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--device", "cpu", "test_suite.py"]
    result = subprocess.run([*run, "--conformance-report", str(report)], cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 1, result.stdout[-2000:]
    written = json.loads(report.read_text())
    outcomes = {entry["test"].split("::")[1]: entry for entry in written["tests"]}
    assert {name: entry["outcome"] for name, entry in outcomes.items()} == {
        "test_passes": "passed",
        "test_fails": "failed",
        "test_skipped": "skipped",
        "test_errors": "error",
    }
    assert outcomes["test_skipped"]["reason"] == "not on this device"
    assert "one is not two" in outcomes["test_fails"]["reason"]
    assert "setup broke" in outcomes["test_errors"]["reason"]
    assert written["summary"] == {**written["summary"], "passed": 1, "failed": 1, "skipped": 1, "error": 1}
    assert written["summary"]["exit_status"] == 1
    assert written["device"] == "cpu" and written["contract"]["platform"] == written["contract"]["omnirun"]

    env = json.loads(
        subprocess.run(
            [sys.executable, "-m", "omnirun.cli", "env", "--json"], capture_output=True, text=True, check=True
        ).stdout
    )
    (cpu,) = [row for row in env["platforms"] if row["name"] == "cpu"]
    moving = {"memory_free"}  # the host's free memory moves between the two processes
    assert {k: v for k, v in written["platform"].items() if k not in moving} == {
        k: v for k, v in cpu.items() if k not in moving
    }
    assert written["default_run"] == cpu["default_run"]
    assert {k: written[k] for k in ("omnirun", "torch", "python")} == {
        k: env[k] for k in ("omnirun", "torch", "python")
    }
