"""Rules of the design that a test can hold: no vendor import at `import omnirun`, no device branches in common/,
no device package importing another."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

COMMON = Path(__file__).resolve().parents[1] / "common"
DEVICES = COMMON.parent / "devices"
TRITON_KERNELS = COMMON / "kernels" / "triton"
VENDOR_MODULES = ["torch_npu", "intel_extension_for_pytorch", "flashinfer", "aiter", "triton", "sgl_kernel"]


def _vendor_modules_imported_by(code: str) -> list[str]:
    """Vendor modules that `code` imports beyond what `import torch` already brought (torch-npu autoloads)."""
    script = (
        "import sys, torch\n"
        f"before = set(sys.modules)\n{code}\n"
        f"print([m for m in {VENDOR_MODULES!r} if m in sys.modules and m not in before])\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    return ast.literal_eval(result.stdout)


def test_import_and_discovery_import_no_vendor_package():
    code = "import omnirun\nfrom omnirun.registry import default_registry\ndefault_registry()"
    assert _vendor_modules_imported_by(code) == []


def test_probing_imports_at_most_the_npu_stack():
    # Probing runs before any device is chosen, so it must stay light: the cuda/rocm/xpu probes find triton,
    # flashinfer, aiter and IPEX without importing them. Only torch_npu has to be imported to learn whether CANN
    # is usable (and torch imports it by itself where it is installed).
    code = "from omnirun.registry import default_registry\n[p.probe() for p in default_registry().platforms.values()]"
    assert set(_vendor_modules_imported_by(code)) <= {"torch_npu"}


def test_common_never_asks_which_device_it_is_on():
    branch = re.compile(r"(device|device_type|platform\.name)[^=!\n]*[=!]= *['\"](cuda|npu|xpu|hip|rocm|musa|cpu)['\"]")
    vendor = re.compile(r"^\s*(import|from) +(" + "|".join(VENDOR_MODULES) + r")\b", re.M)
    # Triton is portable (cuda, rocm, xpu): its kernels live in common/kernels/triton/, which only the capability
    # gate imports (the import tests above and below hold that line).
    portable = re.compile(r"^\s*(import|from) +triton\b")
    offenders = []
    for path in COMMON.rglob("*.py"):
        text = path.read_text()
        offenders += [f"{path.name}: {m.group(0)}" for m in branch.finditer(text)]
        for m in vendor.finditer(text):
            if not (path.is_relative_to(TRITON_KERNELS) and portable.match(m.group(0))):
                offenders.append(f"{path.name}: {m.group(0).strip()}")
    assert offenders == []


def test_building_a_runner_imports_no_vendor_package_on_cpu():
    code = (
        "import omnirun.runner, omnirun.testing\n"
        "from omnirun.registry import get_platform\n"
        "r = omnirun.testing.make_runner(get_platform('cpu'), 'tiny-llama', load_format='dummy')\n"
        "omnirun.testing.greedy_generate(r, [[1, 2, 3]], 2)"
    )
    assert _vendor_modules_imported_by(code) == []


def test_every_package_is_listed_for_installation():
    """pyproject lists packages explicitly (package-dir mapping): a new folder left out would vanish from wheels."""
    import tomllib

    root = COMMON.parent
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = set()
    for top, name in ((COMMON, "omnirun"), (root / "devices", "omnirun.devices")):
        for init in top.rglob("__init__.py"):
            parts = init.parent.relative_to(top).parts
            if "tests" not in parts:
                found.add(".".join((name, *parts)))
    assert found == listed


def _device_packages() -> list[str]:
    """The device packages: folders under devices/ holding a platform.py."""
    return sorted(p.parent.name for p in DEVICES.glob("*/platform.py"))


def device_package_imports_of_others(root: Path = DEVICES) -> list[str]:
    """`file: module` for every import, in a device package, of another device package (tests included)."""
    packages = _device_packages()
    offenders = []
    for own in packages:
        for path in (root / own).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    modules = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module:
                    # `from omnirun.devices import cuda` names the package in the imported name, not the module
                    base = node.module
                    modules = [base] if base.count(".") >= 2 else [f"{base}.{alias.name}" for alias in node.names]
                else:
                    continue
                for module in modules:
                    parts = module.split(".")
                    if parts[:2] == ["omnirun", "devices"] and len(parts) > 2 and parts[2] in packages:
                        if parts[2] != own:
                            offenders.append(f"{path.relative_to(root)}: {module}")
    return sorted(set(offenders))


def test_no_device_package_imports_another():
    """Code two devices share (devices/torch_gpu.py for cuda and rocm) lives beside the packages, not in one."""
    assert len(_device_packages()) >= 5
    assert device_package_imports_of_others() == []


def test_the_device_import_rule_catches_an_import_of_another_package(tmp_path):
    for name in _device_packages():
        (tmp_path / name).mkdir()
    (tmp_path / "rocm" / "platform.py").write_text("from omnirun.devices.cuda.torch_gpu import torch_gpu_build\n")
    (tmp_path / "npu" / "platform.py").write_text("from omnirun.devices import cpu\nimport omnirun.devices.torch_gpu\n")
    assert device_package_imports_of_others(tmp_path) == [
        "npu/platform.py: omnirun.devices.cpu",
        "rocm/platform.py: omnirun.devices.cuda.torch_gpu",
    ]


def test_lanes_list_test_folders_not_test_files():
    """Tests select themselves by capability (markers); a lane names folders, never a hand-made list of files."""
    import tomllib

    root = COMMON.parent
    lanes = tomllib.loads((root / "ci" / "lanes.toml").read_text())["lanes"]
    listed = {path for lane in lanes.values() for path in lane["tests"]}
    assert listed and all((root / path).is_dir() for path in listed), sorted(listed)
