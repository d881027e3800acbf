"""The kernel tests' `DEVICE`: set per test from the `triton_device` fixture (the root conftest decides it from
the --device platform's capabilities), so module helpers can build tensors without a device argument."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _kernel_device(request: pytest.FixtureRequest, triton_device) -> None:
    request.module.DEVICE = triton_device
