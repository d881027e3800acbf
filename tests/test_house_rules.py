"""Rules of the design that a test can hold: no vendor import at `import omnirun`, no device branches in common/,
no device package importing another (what two share lives in device_shared/)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

COMMON = Path(__file__).resolve().parents[1] / "common"
DEVICES = COMMON.parent / "devices"
# Where each import package's source lives (pyproject's package-dir mapping).
IMPORT_NAMES = {"common": "omnirun", "devices": "omnirun.devices", "device_shared": "omnirun.device_shared"}
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
    for folder, name in IMPORT_NAMES.items():
        for init in (root / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(root / folder).parts
            if "tests" not in parts:
                found.add(".".join((name, *parts)))
    assert found == listed


def _device_packages(devices: Path = DEVICES) -> list[str]:
    """The device packages: folders under devices/ holding a platform.py."""
    return sorted(p.parent.name for p in devices.glob("*/platform.py"))


def _imports_of(path: Path, package: str) -> list[str]:
    """The absolute names of the modules `path` imports; `package` (the file's own package) resolves relative ones.
    `from omnirun.devices import cuda` names the package in the imported name, not the module: joined then."""
    modules = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            modules += [base] if base.count(".") >= 2 else [f"{base}.{alias.name}" for alias in node.names]
    return modules


def layout_import_offenders(root: Path = COMMON.parent) -> list[str]:
    """`file: module` for each import that breaks the layout: a device package importing another device package
    (tests included), device_shared/ importing a device package, common/ importing a device package or
    device_shared. A device package may import its own modules and omnirun.device_shared."""
    packages = _device_packages(root / "devices")
    device_names = {f"omnirun.devices.{name}" for name in packages}

    def device_of(module: str) -> str | None:
        return next((d for d in device_names if module == d or module.startswith(d + ".")), None)

    offenders = []
    for folder, top in IMPORT_NAMES.items():
        for path in (root / folder).rglob("*.py"):
            rel = path.relative_to(root / folder)
            package = ".".join((top, *rel.parent.parts))
            own = device_of(package)
            for module in _imports_of(path, package):
                if folder == "common":
                    bad = (
                        module.startswith(("omnirun.devices.", "omnirun.device_shared")) or module == "omnirun.devices"
                    )
                else:
                    imported = device_of(module)
                    bad = imported is not None and imported != own
                if bad:
                    offenders.append(f"{path.relative_to(root)}: {module}")
    return sorted(set(offenders))


def test_no_device_package_imports_another():
    """Code two devices share lives in device_shared/ (torch_gpu for cuda and rocm, ipex_* for xpu and cpu), which
    imports no device package; common/ imports neither."""
    assert len(_device_packages()) >= 5
    assert layout_import_offenders() == []


def test_devices_holds_only_device_packages():
    """Shared code under devices/ would read as one device package importing another: it goes to device_shared/."""
    stray = [p.name for p in DEVICES.iterdir() if p.suffix == ".py" and p.name != "__init__.py"]
    stray += [
        p.name for p in DEVICES.iterdir() if p.is_dir() and p.name != "__pycache__" and p.name not in _device_packages()
    ]
    assert stray == []


def _layout(tmp_path: Path) -> Path:
    """An empty copy of the layout: common/, device_shared/ and devices/<each device package>/platform.py."""
    for name in ("common", "device_shared", *(f"devices/{d}" for d in _device_packages())):
        (tmp_path / name).mkdir(parents=True)
    for device in _device_packages():
        (tmp_path / "devices" / device / "platform.py").write_text("")
    return tmp_path


def test_the_device_import_rule_catches_an_import_of_another_package(tmp_path):
    root = _layout(tmp_path)
    (root / "devices" / "rocm" / "platform.py").write_text(
        "from omnirun.devices.cuda.torch_gpu import torch_gpu_build\n"
    )
    (root / "devices" / "npu" / "platform.py").write_text(
        "from omnirun.devices import cpu\nimport omnirun.device_shared.torch_gpu\nfrom . import npu_graphs\n"
    )
    (root / "devices" / "xpu" / "graphs.py").write_text("from ..cuda import platform\n")
    assert layout_import_offenders(root) == [
        "devices/npu/platform.py: omnirun.devices.cpu",
        "devices/rocm/platform.py: omnirun.devices.cuda.torch_gpu",
        "devices/xpu/graphs.py: omnirun.devices.cuda",
    ]


def test_the_import_rule_catches_device_shared_or_common_importing_a_device(tmp_path):
    root = _layout(tmp_path)
    (root / "device_shared" / "torch_gpu.py").write_text("import torch\nfrom omnirun.devices.rocm import gfx_arch\n")
    (root / "device_shared" / "ipex_ops.py").write_text("from omnirun.device_shared.ipex_support import IPEX\n")
    (root / "common" / "registry.py").write_text(
        "from omnirun.device_shared import torch_gpu\nimport omnirun.devices.cpu\n"
    )
    assert layout_import_offenders(root) == [
        "common/registry.py: omnirun.device_shared.torch_gpu",
        "common/registry.py: omnirun.devices.cpu",
        "device_shared/torch_gpu.py: omnirun.devices.rocm",
    ]


def test_lanes_list_test_folders_not_test_files():
    """Tests select themselves by capability (markers); a lane names folders, never a hand-made list of files."""
    import tomllib

    root = COMMON.parent
    lanes = tomllib.loads((root / "ci" / "lanes.toml").read_text())["lanes"]
    listed = {path for lane in lanes.values() for path in lane["tests"]}
    assert listed and all((root / path).is_dir() for path in listed), sorted(listed)


def _runtime_imports(path: Path, package: str, known: set[str]) -> set[str]:
    """The modules of `known` that `path` imports when it runs (lazy imports in functions included; those under
    `if TYPE_CHECKING:` left out): `from a.b import c` counts as a.b.c where that is a module, else as a.b."""
    tree = ast.parse(path.read_text())
    typing_only = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
        for node in ast.walk(block)
    }
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def import_graph(common: Path = COMMON) -> dict[str, set[str]]:
    """Each module of common/ with the modules of common/ it imports when it runs."""
    modules: dict[str, Path] = {}
    for path in common.rglob("*.py"):
        parts = path.relative_to(common).with_suffix("").parts
        name = ".".join(("omnirun", *parts[: -1 if parts[-1] == "__init__" else None]))
        modules[name] = path
    known = set(modules)
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        graph[name] = _runtime_imports(path, package, known) - {name}
    return graph


def import_circles(common: Path = COMMON) -> list[list[str]]:
    """The import circles among common/'s modules (strongly connected components of more than one module)."""
    graph = import_graph(common)
    # Tarjan's algorithm, iteratively (no recursion limit to meet on a large tree).
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            step = next(edges, None)
            if step is not None:
                if step not in index:
                    index[step] = low[step] = len(index)
                    stack.append(step)
                    on_stack.add(step)
                    work.append((step, iter(sorted(graph[step]))))
                elif step in on_stack:
                    low[node] = min(low[node], index[step])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    circles.append(sorted(component))
    return sorted(circles)


def test_the_facts_are_a_leaf_and_what_needs_only_facts_imports_no_platform():
    """omnirun.facts imports nothing of ours; KV dtypes, model configs, the kernel gate and the attention registry
    read facts, not the Platform that builds parts (issue 31: the Platform is no hub of the import graph)."""
    assert [m for m in _imports_of(COMMON / "facts.py", "omnirun") if m.startswith("omnirun")] == []
    fact_readers = ["memory/kv_dtype.py", "loader/model_config.py", "kernels/__init__.py", "attention/registry.py"]
    for rel in fact_readers:
        imports = _imports_of(COMMON / rel, "omnirun")
        assert not [m for m in imports if m == "omnirun.platform" or m.startswith("omnirun.platform.")], rel


def test_common_has_no_import_circle():
    """Facts in a leaf (omnirun.facts) broke the 20-module circle around the Platform; the fake lanes' hook left
    common/ for test code (tests/support/omnirun_fakes)."""
    assert import_circles() == []


# The house of common/ (issue 31): every module on one floor, found by its longest listed prefix ("" is the package
# itself). The facts are the foundation; a Platform states facts and hands over parts; the parts are built from
# facts; the assembly and the runner put parts together; the engine schedules a runner; the fronts drive engines.
FLOORS = {
    **dict.fromkeys(["facts", "errors", "host_event", "host_to_device", "assets"], 0),
    **dict.fromkeys(["platform", "registry"], 1),
    **dict.fromkeys(
        [
            "attention",
            "kernels",
            "graphs",
            "memory",
            "layers",
            "models",
            "distributed",
            "sampling",
            "loader",
            "quantization",
            "structured",
        ],
        2,
    ),
    **dict.fromkeys(["weights", "batch", "config", "cli_flags", "bandwidth"], 2),
    **dict.fromkeys(["assembly", "runner", "launch", "testing"], 3),
    "engine": 4,
    **dict.fromkeys(["", "server", "cli", "bench", "bench_serve", "env_report", "conformance"], 5),
}
# The arrows up the house keeps: the parts a Platform hands over by default are common/'s (the portable attention
# backends beside its own, the portable fused ops its capabilities allow, torch.distributed's communicator).
ARROWS_UP = {
    ("omnirun.platform", "omnirun.attention.registry"),
    ("omnirun.platform", "omnirun.kernels"),
    ("omnirun.platform", "omnirun.distributed.communicator"),
}


def floor_of(module: str) -> int | None:
    name = module.removeprefix("omnirun").removeprefix(".")
    while name not in FLOORS:
        if not name:
            return None
        name = name.rpartition(".")[0]
    return FLOORS[name]


def arrows_up(common: Path = COMMON) -> set[tuple[str, str]]:
    """(importer, imported) for each import from a lower floor of the house to a higher one."""
    graph = import_graph(common)
    return {(a, b) for a, imported in graph.items() for b in imported if floor_of(a) < floor_of(b)}


def test_every_module_of_common_has_a_floor():
    assert [m for m in import_graph() if floor_of(m) is None] == []


def test_at_most_three_arrows_run_up_the_house():
    assert arrows_up() <= ARROWS_UP and len(ARROWS_UP) <= 3


def test_an_arrow_up_is_found(tmp_path):
    (tmp_path / "facts.py").write_text("def f():\n    from omnirun.runner import ModelRunner\n")
    (tmp_path / "runner.py").write_text("import omnirun.facts\n")
    assert arrows_up(tmp_path) == {("omnirun.facts", "omnirun.runner")}


def test_the_circle_finder_finds_a_planted_circle(tmp_path):
    (tmp_path / "a.py").write_text("from omnirun import b\nimport omnirun.d\n")
    (tmp_path / "b.py").write_text("def f():\n    from omnirun.c import g\n")
    (tmp_path / "c.py").write_text("import omnirun.a\n")
    # d imports a only for type checking: no circle
    (tmp_path / "d.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import omnirun.a\n")
    assert import_circles(tmp_path) == [["omnirun.a", "omnirun.b", "omnirun.c"]]
