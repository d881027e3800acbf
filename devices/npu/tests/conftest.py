"""Fixtures of the npu tests: the fake `torch_npu` (fake_torch_npu.py, beside this file) put in sys.modules for one
test. It computes with torch on CPU tensors, so the ascend ops are checked against the references in the cpu lane
too; in the npu-fake lane the lane's own fake is restored after each test."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # fake_torch_npu.py sits here, outside any package
import fake_torch_npu as fake  # noqa: E402


@pytest.fixture
def torch_npu(monkeypatch: pytest.MonkeyPatch):
    module = fake.make_fake_torch_npu()
    monkeypatch.setitem(sys.modules, "torch_npu", module)
    return module
