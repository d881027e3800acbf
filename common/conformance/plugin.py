"""The conformance suite's pytest plugin, registered through the `pytest11` entry point of omnirun.

It adds `--device` (the platform under test; default $OMNIRUN_DEVICE, else what `auto` picks), the fixtures the
suite uses (`device_name`, `platform`, `tiny_checkpoints`), the `device(name)` marker — a test that needs real
hardware of a platform is skipped with that platform's own probe reason where it is unavailable — and the `slow`
marker. Installed with omnirun, it lets a vendor certify a device package without this repository:

    pip install omnirun mydevice-plugin
    pytest --pyargs omnirun.conformance --device mydev      # or: python -m omnirun.conformance --device mydev
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--device",
        default=None,
        help="omnirun platform the conformance suite runs on (default: $OMNIRUN_DEVICE, else what auto picks)",
    )
    parser.addoption(
        "--conformance-report",
        default=None,
        metavar="PATH",
        help="write the certificate (versions, device, every test's outcome, what a default run builds) as JSON",
    )


def device_under_test(config: pytest.Config) -> str:
    """--device, else $OMNIRUN_DEVICE, else the platform `--device auto` picks (as the omnirun CLI does)."""
    chosen = config.getoption("--device") or os.environ.get("OMNIRUN_DEVICE")
    if chosen:
        return chosen
    from omnirun.registry import select_platform

    return select_platform("auto").name


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "device(name): needs the named device available; skipped with the probe's reason otherwise"
    )
    config.addinivalue_line("markers", "slow: takes a minute or more on a small CPU (deselect with -m 'not slow')")
    report = config.getoption("--conformance-report")
    # Under pytest-xdist each worker's outcomes reach the controller, which writes the one report: a worker
    # (config.workerinput) writing its half would race it.
    if report and not hasattr(config, "workerinput"):
        from omnirun.conformance.report import ConformanceReport

        config.pluginmanager.register(ConformanceReport(report, device_under_test(config)), "omnirun-report")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not any(item.get_closest_marker("device") for item in items):
        return
    from omnirun.registry import default_registry

    registry = default_registry()
    for item in items:
        for marker in item.iter_markers(name="device"):
            name = marker.args[0]
            platform = registry.platforms.get(name)
            if platform is None:
                item.add_marker(pytest.mark.skip(reason=f"needs {name}: no such platform is registered"))
            elif not (probe := platform.probe()).available:
                item.add_marker(pytest.mark.skip(reason=f"needs {name}: {probe.reason}"))


@pytest.fixture(scope="session")
def device_name(request: pytest.FixtureRequest) -> str:
    return device_under_test(request.config)


@pytest.fixture(scope="session")
def platform(device_name: str):
    """The platform under test. Unavailable is a failure, not a skip: certifying a missing device proves nothing."""
    from omnirun.registry import get_platform

    platform = get_platform(device_name)
    platform.require_available()
    return platform


@dataclasses.dataclass
class Checkpoint:
    name: str
    hf_model: object  # the HF reference model, float32, on the platform's device
    plain: Path  # one model.safetensors
    sharded: Path  # several shards + model.safetensors.index.json


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory, platform) -> dict[str, Checkpoint]:
    """Tiny random HF checkpoints of every supported architecture, saved with `save_pretrained` (safetensors), once
    in one file and once sharded with an index; HF transformers is the reference they are compared against."""
    from omnirun.testing import tiny_configs, tiny_hf_model

    out = {}
    for name in tiny_configs():
        model = tiny_hf_model(name)
        root = tmp_path_factory.mktemp(name)
        model.save_pretrained(root / "plain")
        model.save_pretrained(root / "sharded", max_shard_size="40KB")
        assert (root / "sharded" / "model.safetensors.index.json").exists()
        out[name] = Checkpoint(name, model.to(platform.device()), root / "plain", root / "sharded")
    return out
