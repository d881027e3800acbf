"""NpuPlatform without Ascend hardware: identity, every probe reason, lazy torch_npu, and the fake-device checks.

Checks that need `torch.device("npu")` live in npu_fake_device_checks.py and run in a child process (see there).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from omnirun.devices.npu.platform import NpuPlatform
from omnirun.errors import DeviceUnavailableError
from omnirun.registry import default_registry
from omnirun_fakes.lane import SUPPORT, without_fake_lane

TESTS = Path(__file__).parent


def _load_fake():
    spec = importlib.util.spec_from_file_location("fake_torch_npu", TESTS / "fake_torch_npu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


fake = _load_fake()


def test_identity():
    platform = default_registry().get("npu")
    assert isinstance(platform, NpuPlatform)  # the npu-fake lane registers a subclass standing on the host
    real = NpuPlatform()
    assert (real.name, real.torch_device_type, real.dispatch_key) == ("npu", "npu", "PrivateUse1")
    assert real.visible_devices_env == "ASCEND_RT_VISIBLE_DEVICES"
    assert real.distributed_backend == "hccl"
    assert real.extra == "npu" and platform.vendor_packages == ("torch-npu",)
    assert real.auto_priority == 90


def test_probe_without_torch_npu_names_the_extra(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, package=None: None if name == "torch_npu" else real_find_spec(name)
    )
    probe = NpuPlatform().probe()
    assert not probe.available
    assert probe.reason.startswith('torch-npu is not installed: pip install "omnirun[npu]"')
    assert "pins the torch version" in probe.reason


HCCL_MISSING = ImportError(
    "libhccl.so: cannot open shared object file: No such file or directory. Please check that the cann package is "
    "installed. Please run 'source set_env.sh' in the CANN installation path.\n"
    "[ERROR] 2025-06-06-10:00:00 (PID:1, Device:-1, RankID:-1) ERR00005 PTA resource not found"
)


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (HCCL_MISSING, ["(libhccl.so: cannot open shared object file: No such file or directory)", "set_env.sh"]),
        (
            OSError("libascendcl.so: cannot open shared object file: No such file or directory"),
            ["(libascendcl.so: cannot open shared object file", "CANN toolkit is missing", "set_env.sh"],
        ),
        (
            ImportError("/site-packages/torch_npu/lib/libtorch_npu.so: undefined symbol: _ZN3c104impl3cow"),
            ["undefined symbol", "was built for another torch than"],
        ),
        (
            RuntimeError("Two accelerators cannot be used at the same time in PyTorch: npu and cuda."),
            ["import torch_npu failed: RuntimeError: Two accelerators cannot be used"],
        ),
        # torch-npu of the torch 2.1 era prints the loader error and calls sys.exit() when CANN is missing.
        (SystemExit(), ["import torch_npu called sys.exit() after printing its error", "set_env.sh"]),
    ],
    ids=["libhccl-missing", "libascendcl-missing", "torch-mismatch", "two-accelerators", "sys-exit"],
)
def test_probe_turns_a_failing_import_into_a_one_line_reason(monkeypatch, error, expected):
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    monkeypatch.setattr(sys, "meta_path", [fake.BrokenTorchNpuFinder(error), *sys.meta_path])
    platform = NpuPlatform()
    probe = platform.probe()  # never raises, SystemExit included
    assert not probe.available
    for fragment in expected:
        assert fragment in probe.reason
    assert "\n" not in probe.reason and "Please check" not in probe.reason
    with pytest.raises(DeviceUnavailableError, match="device 'npu' is unavailable: import torch_npu"):
        platform.current_device()


def _run_python(code: str, fake_torch_npu_dir: Path) -> None:
    # These children test the real platform's own imports: the npu-fake lane's hook stays out of them.
    env = without_fake_lane()
    # fake_torch_npu imports omnirun_fakes (tests/support), which pytest's `pythonpath` gives only to itself.
    path = [str(fake_torch_npu_dir), str(SUPPORT), env.get("PYTHONPATH")]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, path))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr


def test_import_and_construction_do_not_import_torch_npu(tmp_path):
    fake.write_importable_torch_npu(tmp_path)  # importable, so an eager import anywhere would show
    _run_python(
        "import sys, omnirun\n"
        "from omnirun.registry import default_registry\n"
        "from omnirun.devices.npu.platform import NpuPlatform\n"
        "platform = default_registry().get('npu')\n"
        "assert platform.package_versions() == {'torch-npu': None}\n"
        "assert 'torch_npu' not in sys.modules, 'torch_npu was imported eagerly'\n",
        tmp_path,
    )


def test_first_device_call_imports_torch_npu_so_npu_devices_parse(tmp_path):
    fake.write_importable_torch_npu(tmp_path)
    _run_python(
        "import sys, torch\n"
        "from omnirun.devices.npu.platform import NpuPlatform\n"
        "platform = NpuPlatform()\n"
        "assert platform.device(1) == torch.device('npu', 1)\n"
        "assert 'torch_npu' in sys.modules and platform.device_module is torch.npu\n"
        "assert platform.probe().device_count == 2\n",
        tmp_path,
    )


def test_platform_against_fake_torch_npu_in_its_own_process(request):
    checks = TESTS / "npu_fake_device_checks.py"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", str(checks), "-q", "-p", "no:cacheprovider"],
        capture_output=True,
        text=True,
        cwd=request.config.rootpath,
        env=without_fake_lane(),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert " passed" in result.stdout and "skipped" not in result.stdout
