"""Finding IPEX without importing it, and the version rule: IPEX X.Y only beside torch X.Y, XPU builds for xpu."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from omnirun.device_shared.ipex_support import build_of, ipex_notes, ipex_status, major_minor


def test_versions_compare_by_major_minor() -> None:
    assert major_minor("2.8.10+xpu") == "2.8" and major_minor("2.13.0+cpu") == "2.13" and major_minor("dev") is None
    assert build_of("2.8.10+xpu") == "xpu" and build_of("2.8.0+cpu") == "cpu" and build_of("2.8.0") == "cpu"


def test_matching_build_is_usable(install_ipex) -> None:
    module = install_ipex("xpu")
    status = ipex_status("xpu")
    assert status.usable and status.version == module.__version__ and status.reason == ""
    assert ipex_notes("xpu") == ()


def test_mismatched_torch_falls_back_with_the_reason(install_ipex) -> None:
    install_ipex("xpu", "2.8.10+xpu")
    status = ipex_status("xpu", torch_version="2.13.0+xpu")
    assert not status.usable
    assert status.reason == "ipex: intel-extension-for-pytorch 2.8.10+xpu needs torch 2.8, found 2.13"


def test_the_other_build_is_not_used(install_ipex) -> None:
    install_ipex("cpu")
    status = ipex_status("xpu")
    assert not status.usable and "is a CPU build; the xpu platform needs its XPU build" in status.reason
    install_ipex("xpu")
    assert "is a XPU build; the cpu platform needs its CPU build" in ipex_status("cpu").reason


def test_not_installed_says_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "intel_extension_for_pytorch" else real(name, *a)
    )
    assert ipex_status("xpu") == ipex_status("cpu")
    assert not ipex_status("xpu").usable and ipex_notes("cpu") == ()


def test_importable_without_metadata(monkeypatch: pytest.MonkeyPatch, install_ipex) -> None:
    module = install_ipex("xpu")
    import importlib.metadata

    def missing(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert sys.modules["intel_extension_for_pytorch"] is module
    assert "not installed as intel-extension-for-pytorch" in ipex_status("xpu").reason
