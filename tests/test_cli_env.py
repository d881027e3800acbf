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


def test_table_lists_every_platform_with_status_or_reason():
    result = omnirun("env")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("omnirun ") and "torch " in lines[0]
    rows = {line.split()[0]: line for line in lines[3:]}
    assert set(IN_TREE) <= set(rows)
    assert "available" in rows["cpu"] and "gloo" in rows["cpu"] and "GiB" in rows["cpu"]
    for name in IN_TREE:
        probe = default_registry().get(name).probe()
        expected = "available" if probe.available else f"unavailable: {probe.reason}"
        assert rows[name].endswith(expected)


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
