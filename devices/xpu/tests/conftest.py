"""Stubs for the xpu lane on machines without an Intel GPU.

`fake_xpu` makes this torch look like an XPU build: `torch._C._has_xpu` is set and the torch.xpu functions the
platform uses are replaced by recorders with torch 2.13's signatures. `write_package` lays out an installed
distribution (package + .dist-info/METADATA) the way pip does, for IPEX and triton look-alikes.
"""

from __future__ import annotations

import dataclasses
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

GiB = 1 << 30


@dataclasses.dataclass
class FakeDeviceProperties:
    """The fields of torch._C._XpuDeviceProperties the platform reads, with a Max 1550's values by default."""

    name: str = "Intel(R) Data Center GPU Max 1550"
    has_fp16: bool = True
    has_fp64: bool = True
    has_bfloat16_conversions: bool = True
    is_integrated_gpu: bool = False
    total_memory: int = 64 * GiB


class FakeXpu:
    """Stands in for torch.xpu of an XPU build; records every call that reaches it as (name, args)."""

    def __init__(self) -> None:
        self.count = 2
        self.current = 0
        self.properties = FakeDeviceProperties()
        self.free_memory = 60 * GiB
        self.mem_get_info_error: RuntimeError | None = None
        self.reserved = 0
        self.peak = 0
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def called(self, name: str) -> list[tuple[Any, ...]]:
        return [args for call, args in self.calls if call == name]

    # --- torch.xpu functions, same signatures as torch 2.13 ---
    def _lazy_init(self) -> None:
        self.calls.append(("_lazy_init", ()))

    def device_count(self) -> int:
        self.calls.append(("device_count", ()))
        return self.count

    def current_device(self) -> int:
        self.calls.append(("current_device", ()))
        return self.current

    def set_device(self, device: Any) -> None:
        self.calls.append(("set_device", (device,)))

    def synchronize(self, device: Any = None) -> None:
        self.calls.append(("synchronize", (device,)))

    def get_device_properties(self, device: Any = None) -> FakeDeviceProperties:
        self.calls.append(("get_device_properties", (device,)))
        return self.properties

    def mem_get_info(self, device: Any = None) -> tuple[int, int]:
        self.calls.append(("mem_get_info", (device,)))
        if self.mem_get_info_error is not None:
            raise self.mem_get_info_error
        return self.free_memory, self.properties.total_memory

    def memory_reserved(self, device: Any = None) -> int:
        self.calls.append(("memory_reserved", (device,)))
        return self.reserved

    def empty_cache(self) -> None:
        self.calls.append(("empty_cache", ()))

    def max_memory_allocated(self, device: Any = None) -> int:
        self.calls.append(("max_memory_allocated", (device,)))
        return self.peak

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        self.calls.append(("reset_peak_memory_stats", (device,)))

    def manual_seed_all(self, seed: int) -> None:
        self.calls.append(("manual_seed_all", (seed,)))

    def Stream(self, device: Any = None, priority: int = 0) -> tuple[str, Any]:  # noqa: N802 - torch's class name
        self.calls.append(("Stream", (device,)))
        return ("stream", device)

    def Event(self, enable_timing: bool = False) -> tuple[str, bool]:  # noqa: N802 - torch's class name
        self.calls.append(("Event", (enable_timing,)))
        return ("event", enable_timing)


_STUBBED = (
    "_lazy_init",
    "device_count",
    "current_device",
    "set_device",
    "synchronize",
    "get_device_properties",
    "mem_get_info",
    "memory_reserved",
    "empty_cache",
    "max_memory_allocated",
    "reset_peak_memory_stats",
    "manual_seed_all",
    "Stream",
    "Event",
)


@pytest.fixture
def fake_xpu(monkeypatch: pytest.MonkeyPatch) -> FakeXpu:
    fake = FakeXpu()
    monkeypatch.setattr(torch._C, "_has_xpu", True)
    for name in _STUBBED:
        monkeypatch.setattr(torch.xpu, name, getattr(fake, name))
    monkeypatch.delenv("ZE_AFFINITY_MASK", raising=False)
    return fake


@pytest.fixture
def write_package():
    """write_package(root, import_name, dist_name=None, version=None, init="", subdirs=()) -> package dir.

    With dist_name and version it also writes `<dist_name>-<version>.dist-info/METADATA`, which is what
    importlib.metadata.version() reads for an installed distribution.
    """

    def write(
        root: Path,
        import_name: str,
        dist_name: str | None = None,
        version: str | None = None,
        init: str = "",
        subdirs: tuple[str, ...] = (),
    ) -> Path:
        package = root / import_name
        package.mkdir(parents=True)
        (package / "__init__.py").write_text(textwrap.dedent(init))
        for sub in subdirs:
            (package / sub).mkdir(parents=True)
            (package / sub / "__init__.py").write_text("")
        if dist_name is not None and version is not None:
            # pip names the folder after the distribution, normalised: pytorch-triton-xpu → pytorch_triton_xpu
            dist_info = root / f"{dist_name.replace('-', '_')}-{version}.dist-info"
            dist_info.mkdir()
            (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist_name}\nVersion: {version}\n")
        return package

    return write


@pytest.fixture
def install_ipex(monkeypatch: pytest.MonkeyPatch, tmp_path):
    """install_ipex(build="xpu", version=None) -> the fake IPEX module, in sys.modules with pip's metadata on
    sys.path and its ops on torch.ops.torch_ipex (version None: one that matches this torch). Undone after the
    test."""
    import sys as _sys

    _sys.path.insert(0, str(Path(__file__).resolve().parent))
    try:
        from fake_ipex import install_metadata, make_ipex, matching_version
    finally:
        _sys.path.pop(0)

    def install(build: str = "xpu", version: str | None = None):
        version = version or matching_version(build)
        module = make_ipex(build, version)
        root = tmp_path / f"ipex-{build}-{version}"
        install_metadata(root, version)
        monkeypatch.syspath_prepend(str(root))
        monkeypatch.setitem(_sys.modules, "intel_extension_for_pytorch", module)
        for name, op in module.torch_ops.items():  # what importing IPEX registers on torch.ops.torch_ipex
            monkeypatch.setattr(torch.ops.torch_ipex, name, op, raising=False)
        return module

    return install
