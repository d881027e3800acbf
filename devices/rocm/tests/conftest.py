"""Fixtures of the rocm tests: the fake `aiter` (fake_aiter.py, beside this file) put in sys.modules for one test.

They run in every lane: the fake computes with torch on CPU tensors, so the aiter backend and norms are checked
against torch_native in the cpu lane too; in the rocm-fake lane the lane's own fake is restored after each test.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # fake_aiter.py sits here, outside any package
from fake_aiter import make_aiter, modules  # noqa: E402


@pytest.fixture
def use_aiter(monkeypatch: pytest.MonkeyPatch):
    """use_aiter(gfx="gfx942"): a fresh fake aiter for that GPU target in sys.modules, returned."""

    def install(gfx: str = "gfx942"):
        module = make_aiter(gfx)
        for name, part in modules(module).items():
            monkeypatch.setitem(sys.modules, name, part)
        return module

    return install


@pytest.fixture
def aiter(use_aiter):
    return use_aiter("gfx942")


@pytest.fixture
def fake_rocm(aiter):
    """The rocm-fake lane's platform (an MI300X of CPU tensors over the fake aiter), built afresh for one test."""
    spec = importlib.util.spec_from_file_location("omnirun_rocm_fake_lane", HERE / "fake_lane.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # each device has a fake_lane.py: loaded under a name of its own
    return module.FakeRocmPlatform()
