"""`omnirun env` as a user runs it: every platform with its status, and one-line errors for unusable devices."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from omnirun.registry import default_registry

IN_TREE = ["cuda", "rocm", "npu", "xpu", "cpu"]


def omnirun(*args: str, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "OMNIRUN_DEVICE"} | env
    return subprocess.run(
        [sys.executable, "-m", "omnirun.cli", *args], env=environ, capture_output=True, text=True, timeout=120
    )


def _blocks(text: str) -> dict[str, list[str]]:
    """The report's platform blocks by name (blocks are separated by empty lines; the header is the first)."""
    blocks = [b.splitlines() for b in text.split("\n\n")[1:]]
    return {b[0].split()[0]: b for b in blocks}


def _status(block: list[str]) -> str:
    """A block's status text, its wrapped lines joined (field lines start with exactly two spaces)."""
    status = [block[0].split(maxsplit=1)[1]]
    for line in block[1:]:
        if line.startswith("  ") and not line.startswith("   "):
            break
        status.append(line.strip())
    return " ".join(status)


def test_report_lists_every_platform_with_status_or_reason():
    result = omnirun("env")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("omnirun ") and "torch " in lines[0]
    blocks = _blocks(result.stdout)
    assert set(IN_TREE) <= set(blocks)
    cpu = "\n".join(blocks["cpu"])
    assert "  dist        gloo" in cpu and "GiB free of" in cpu and "  attention   torch_native" in cpu
    for name in IN_TREE:
        probe = default_registry().get(name).probe()
        expected = "available" if probe.available else f"unavailable: {probe.reason}"
        assert _status(blocks[name]) == expected


def test_no_line_of_the_report_exceeds_100_columns():
    result = omnirun("env")
    assert result.returncode == 0, result.stderr
    assert max(len(line) for line in result.stdout.splitlines()) <= 100, result.stdout


def test_long_values_wrap_under_their_field():
    from omnirun.env_report import PlatformRow, to_table

    reason = "the vendor stack says " + "something long " * 20 + "https://example.com/" + "x" * 120
    packages = {f"package-{i}": f"{i}.0" for i in range(12)}
    row = PlatformRow("plugin", "unavailable", reason, 0, None, None, None, "gloo", [], [], None, packages, ["a note"])
    lines = to_table([row], None).splitlines()
    assert max(len(line) for line in lines) <= 100, "\n".join(lines)
    # every character of the reason, in order (the 120-column word is cut where it reaches the edge)
    assert _status(lines[3:]).replace(" ", "") == f"unavailable: {reason}".replace(" ", "")
    text = " ".join(line.strip() for line in lines)
    assert all(f"package-{i} {i}.0" in text for i in range(12)) and "notes       a note" in "\n".join(lines)


def test_json_report():
    result = omnirun("env", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    rows = {row["name"]: row for row in report["platforms"]}
    assert report["torch"] and set(IN_TREE) <= set(rows)
    cpu = rows["cpu"]
    assert cpu["status"] == "available" and cpu["distributed_backend"] == "gloo"
    assert 0 < cpu["memory_free"] <= cpu["memory_total"]
    assert "torch_native" in cpu["attention_backends"]
    assert {rows[n]["distributed_backend"] for n in ("cuda", "rocm", "npu", "xpu")} == {"nccl", "hccl", "xccl"}
    for row in rows.values():
        assert (row["status"] == "available") == (row["reason"] == "")


@pytest.mark.skipif(importlib.util.find_spec("torch_npu") is not None, reason="torch_npu is installed here")
@pytest.mark.parametrize("how", ["flag", "env"])
def test_unavailable_device_is_a_one_line_error_naming_the_extra(how):
    result = omnirun("env", "--device", "npu") if how == "flag" else omnirun("env", OMNIRUN_DEVICE="npu")
    assert result.returncode != 0
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("omnirun: error: device 'npu' is unavailable: ")
    assert 'pip install "omnirun[npu]"' in result.stderr


def test_selected_device_shows_only_its_row():
    result = omnirun("env", "--device", "cpu", "--json")
    report = json.loads(result.stdout)
    assert report["selected"] == "cpu" and [r["name"] for r in report["platforms"]] == ["cpu"]


def test_unknown_device_lists_choices():
    result = omnirun("env", "--device", "tpu")
    assert result.returncode != 0 and "unknown device 'tpu': choose one of" in result.stderr


def test_no_command_prints_help():
    result = omnirun()
    assert result.returncode != 0 and "env" in result.stdout
