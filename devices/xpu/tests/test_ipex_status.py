"""omnirun.devices.ipex: IPEX is used only when installed and built for this torch's major.minor."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

from omnirun.devices import ipex

MODULE = "intel_extension_for_pytorch"
# IPEX 2.8.10+xpu is the last XPU release; its development stopped there (intel-extension-for-pytorch#867).
LAST_RELEASE = "2.8.10+xpu"


@pytest.fixture(autouse=True)
def fresh_ipex_state(monkeypatch: pytest.MonkeyPatch):
    """Pin torch's version, forget load_ipex's answer, and unload any look-alike IPEX afterwards."""
    monkeypatch.setattr(torch, "__version__", "2.13.0+xpu")
    ipex.load_ipex.cache_clear()
    yield
    ipex.load_ipex.cache_clear()
    sys.modules.pop(MODULE, None)


@pytest.fixture
def install_ipex(monkeypatch: pytest.MonkeyPatch, tmp_path, write_package):
    """install_ipex(version or None): an IPEX look-alike on sys.path, with pip's metadata unless version is None."""

    def install(version: str | None) -> None:
        write_package(tmp_path, MODULE, ipex.DISTRIBUTION, version, init="LOOK_ALIKE = True\n")
        monkeypatch.syspath_prepend(tmp_path)

    return install


@pytest.mark.skipif(importlib.util.find_spec(MODULE) is not None, reason="a real IPEX is installed here")
def test_not_installed() -> None:
    usable, why = ipex.ipex_status()
    assert not usable
    assert why == "intel-extension-for-pytorch is not installed (optional)"
    assert ipex.load_ipex() is None


def test_matching_torch_minor_is_used(install_ipex) -> None:
    install_ipex("2.13.10+xpu")
    assert ipex.ipex_status() == (True, "intel-extension-for-pytorch 2.13.10+xpu")
    module = ipex.load_ipex()
    assert module is not None and module.LOOK_ALIKE


def test_last_release_beside_newer_torch_is_not_used(install_ipex) -> None:
    install_ipex(LAST_RELEASE)
    usable, why = ipex.ipex_status()
    assert not usable
    assert f"intel-extension-for-pytorch {LAST_RELEASE}" in why
    assert "torch 2.13.0+xpu" in why
    assert ipex.load_ipex() is None
    assert MODULE not in sys.modules  # a mismatched IPEX is never imported


def test_importable_without_metadata_is_not_used(install_ipex) -> None:
    install_ipex(None)
    usable, why = ipex.ipex_status()
    assert not usable
    assert "no package metadata" in why
    assert MODULE not in sys.modules


def test_status_reads_metadata_without_importing(install_ipex) -> None:
    install_ipex("2.13.10+xpu")
    ipex.ipex_status()
    assert MODULE not in sys.modules
