"""This repository's test setup, on top of the conformance plugin (`omnirun.conformance.plugin`, loaded through
omnirun's `pytest11` entry point), which brings `--device` (the platform a lane checks), the `device(name)` marker
and the `device_name`, `platform` and `tiny_checkpoints` fixtures.

`@pytest.mark.triton` marks a Triton kernel test. Tests select by capability, not by lane: where the `--device`
platform's capabilities offer triton (the gate in `omnirun.kernels`), the kernels compile and run on that device;
elsewhere they run in Triton's interpreter on CPU tensors. The `triton_device` fixture says which.

A fake lane (`ci/run-lane npu-fake`, ...) puts its fake in place through a registry hook that only the lane's
PYTHONPATH names (tests/support/omnirun_fakes/lane.py): the fake vendor modules and the fake platform are installed
when the registry is first discovered, here before anything asks it for the device.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import pytest
import torch


@functools.cache
def _compiles_triton(device_name: str) -> bool:
    """Whether the --device platform is available here and its capabilities offer the Triton kernels."""
    from omnirun.kernels import offers_triton
    from omnirun.registry import default_registry

    platform = default_registry().platforms.get(device_name)
    return platform is not None and platform.probe().available and offers_triton(platform.capabilities)


def pytest_configure(config: pytest.Config) -> None:
    # Under pytest-xdist the workers share the cores: each gets its share of torch's threads, and so do the
    # processes its tests start (tensor-parallel ranks, servers). OpenMP threads spin while they wait, and two
    # workers of two threads on two cores made the engine soaks 25x slower (135 s against 5.5).
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        threads = max(1, (os.cpu_count() or 1) // workers)
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)

    from omnirun.registry import default_registry

    default_registry()  # a fake lane's registry hook installs its fake here, before any test asks for it
    # Where the device cannot compile Triton, its kernels run in the interpreter. The switch must be set before
    # anything imports triton (transformers may, while tests are being collected), because triton reads it once.
    from omnirun.conformance.plugin import device_under_test

    if not _compiles_triton(device_under_test(config)):
        os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if importlib.util.find_spec("triton") is None:
        for item in items:
            if item.get_closest_marker("triton") is not None:
                item.add_marker(pytest.mark.skip(reason="needs triton, which is not installed: pip install triton"))


@pytest.fixture(scope="session")
def triton_device(device_name: str) -> torch.device:
    """Where a Triton kernel test puts its tensors: the lane's device if it compiles triton, else the CPU (the
    kernels then run in Triton's interpreter)."""
    if _compiles_triton(device_name):
        from omnirun.registry import get_platform

        return get_platform(device_name).device(0)
    return torch.device("cpu")


@pytest.fixture(scope="session")
def compiled_triton_platform(device_name: str):
    """The lane's platform, for a kernel test that needs compiled kernels (a graph capture, a tuned launch at a
    real shape); skipped where the kernels run in the interpreter."""
    if not _compiles_triton(device_name):
        pytest.skip(f"needs a --device whose capabilities offer triton compiled ({device_name!r} runs it interpreted)")
    from omnirun.registry import get_platform

    return get_platform(device_name)
