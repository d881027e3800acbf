"""Test-wide options: `--device` picks the platform the conformance suite checks (a lane = one device).

`@pytest.mark.device("cuda")` marks a test that needs real hardware of that platform; it is skipped, with the
platform's own probe reason, wherever that device is unavailable.
"""

from __future__ import annotations

import os

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--device",
        default=os.environ.get("OMNIRUN_DEVICE", "cpu"),
        help="platform the conformance suite runs on (default: $OMNIRUN_DEVICE or cpu)",
    )


def pytest_configure(config: pytest.Config) -> None:
    # Without a GPU, Triton kernels run in Triton's interpreter. The switch must be set before anything imports
    # triton (transformers may, while tests are being collected), because triton reads it once.
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
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
    return request.config.getoption("--device")


@pytest.fixture(scope="session")
def platform(device_name: str):
    """The lane's platform. Unavailable is a failure, not a skip: a lane run where its device is missing is broken."""
    from omnirun.registry import get_platform

    platform = get_platform(device_name)
    platform.require_available()
    return platform
