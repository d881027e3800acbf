"""A stand-in for torch_npu that follows its documented Python API, to test the npu platform without Ascend hardware.

Signatures follow torch_npu/npu/{__init__,utils,memory,streams}.py (github.com/Ascend/pytorch): every device
argument takes an int, a torch.device or None (the current device), like torch.cuda. The fake records the calls
the platform makes and, like torch_npu's `_lazy_init`, notes when something would have initialised the device.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import types
from pathlib import Path

import torch

GIB = 1 << 30


class FakeNpu:
    """`torch.npu` (the same object as `torch_npu.npu`)."""

    def __init__(self, device_count: int = 2, device_name: str = "Ascend910B3", bf16: bool = True):
        self.count = device_count
        self.device_name = device_name
        self.bf16 = bf16
        self.current = 0
        self.free, self.total = 40 * GIB, 64 * GIB
        self.peak = 3 * GIB
        self.initialized = False
        self.calls: list[tuple[str, object]] = []

    def _lazy_init(self) -> None:
        self.initialized = True

    def _index(self, device: int | str | torch.device | None) -> int:
        if isinstance(device, str):
            device = torch.device(device)
        if isinstance(device, torch.device):
            assert device.type == "npu", f"expected an npu device, got {device}"
            device = device.index
        return self.current if device is None else device

    def is_available(self) -> bool:
        return self.device_count() > 0

    def device_count(self) -> int:
        # torch_npu asks the driver (ascend_hal) and does not initialise a device.
        return self.count

    def set_device(self, device: int | str | torch.device) -> None:
        self.calls.append(("set_device", device))
        self.current = self._index(device)

    def current_device(self) -> int:
        self._lazy_init()
        return self.current

    def synchronize(self, device: int | torch.device | None = None) -> None:
        self._lazy_init()
        self.calls.append(("synchronize", device))

    def get_device_name(self, device_name: int | torch.device | None = None) -> str:
        self._lazy_init()
        self.calls.append(("get_device_name", device_name))
        return self.device_name

    def is_bf16_supported(self) -> bool:
        self._lazy_init()
        return self.bf16

    def mem_get_info(self, device: int | torch.device | None = None) -> tuple[int, int]:
        self._lazy_init()
        self.calls.append(("mem_get_info", device))
        return self.free, self.total

    def empty_cache(self) -> None:
        self.calls.append(("empty_cache", None))

    def max_memory_allocated(self, device: int | torch.device | None = None) -> int:
        self.calls.append(("max_memory_allocated", device))
        return self.peak

    def reset_peak_memory_stats(self, device: int | torch.device | None = None) -> None:
        self.calls.append(("reset_peak_memory_stats", device))

    def _is_in_bad_fork(self) -> bool:
        return False  # torch.manual_seed asks this before it seeds the PrivateUse1 device through manual_seed_all

    def manual_seed_all(self, seed: int) -> None:
        self.calls.append(("manual_seed_all", seed))

    def Stream(self, device: int | torch.device | None = None, priority: int = 0) -> types.SimpleNamespace:  # noqa: N802
        return types.SimpleNamespace(device_index=self._index(device), priority=priority)

    def Event(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):  # noqa: N802
        return types.SimpleNamespace(enable_timing=enable_timing, blocking=blocking, interprocess=interprocess)


def make_torch_npu(npu: FakeNpu) -> types.ModuleType:
    """The `torch_npu` module around `npu`, with the spec an installed package reports to importlib.util.find_spec."""
    module = types.ModuleType("torch_npu")
    module.__spec__ = importlib.machinery.ModuleSpec("torch_npu", loader=None)
    module.npu = npu
    return module


class BrokenTorchNpuFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Makes torch_npu installed but failing on import with `error`, as it does where CANN is missing."""

    def __init__(self, error: BaseException):
        self.error = error

    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name == "torch_npu" else None

    def create_module(self, spec):
        return None  # the default module object

    def exec_module(self, module):
        raise self.error


def write_importable_torch_npu(directory: Path) -> None:
    """A `torch_npu` package under `directory` whose import registers a FakeNpu the way the real one registers.

    For subprocesses only: the PrivateUse1 rename cannot be undone in a process.
    """
    package = directory / "torch_npu"
    package.mkdir()
    (package / "__init__.py").write_text(
        "import sys\n"
        "import torch\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from fake_torch_npu import FakeNpu\n"
        "npu = FakeNpu()\n"
        'torch.utils.rename_privateuse1_backend("npu")\n'
        'torch._register_device_module("npu", npu)\n'
    )
