"""An out-of-tree platform is a first-class citizen: pip-install a tiny plugin package, then select it by name.

Each plugin is a real distribution, built and installed by pip into its own folder, found through the
`omnirun.platforms` entry points of its metadata — exactly how a vendor's package would be.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from omnirun.registry import default_registry

REPO = Path(__file__).resolve().parents[1]

TOY = """
from omnirun.devices.cpu.platform import CpuPlatform


class ToyPlatform(CpuPlatform):
    \"\"\"A vendor device that happens to compute in host memory.\"\"\"

    name = "toy"
    extra = None
    vendor_packages = ("omnirun-toy-plugin",)
    auto_priority = 60
"""

BROKEN = """
raise ImportError("libbroken.so: cannot open shared object file")
"""


def _pip_install_plugin(tmp: Path, dist: str, module: str, source: str, entry: str) -> Path:
    """Build and install one plugin distribution into its own folder; returns the folder to put on PYTHONPATH."""
    src = tmp / f"{dist}-src"
    src.mkdir()
    (src / f"{module}.py").write_text(textwrap.dedent(source))
    (src / "pyproject.toml").write_text(
        textwrap.dedent(f"""
        [build-system]
        requires = ["setuptools>=68"]
        build-backend = "setuptools.build_meta"

        [project]
        name = "{dist}"
        version = "0.1.0"

        [project.entry-points."omnirun.platforms"]
        {entry}

        [tool.setuptools]
        py-modules = ["{module}"]
        """)
    )
    target = tmp / f"{dist}-site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
         "--target", str(target), str(src)],
        check=True,
    )  # fmt: skip
    return target


@pytest.fixture(scope="module")
def plugins(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("plugins")
    return {
        "toy": _pip_install_plugin(tmp, "omnirun-toy-plugin", "omnirun_toy", TOY, 'toy = "omnirun_toy:ToyPlatform"'),
        "clone": _pip_install_plugin(
            tmp, "omnirun-toy-clone", "omnirun_clone", TOY, 'toy = "omnirun_clone:ToyPlatform"'
        ),
        "broken": _pip_install_plugin(tmp, "omnirun-broken", "omnirun_broken", BROKEN, 'broken = "omnirun_broken:X"'),
    }


def run_with(sites: list[Path], *args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "OMNIRUN_DEVICE"}
    env["PYTHONPATH"] = os.pathsep.join(map(str, sites))
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, cwd=cwd, timeout=600)


def test_installed_plugin_is_listed_and_selected_by_name(plugins):
    listed = run_with([plugins["toy"]], "-m", "omnirun.cli", "env", "--json")
    assert listed.returncode == 0, listed.stderr
    rows = {row["name"]: row for row in json.loads(listed.stdout)["platforms"]}
    assert rows["toy"]["status"] == "available"
    assert rows["toy"]["packages"] == {"omnirun-toy-plugin": "0.1.0"}

    chosen = run_with([plugins["toy"]], "-m", "omnirun.cli", "env", "--device", "toy", "--json")
    assert chosen.returncode == 0, chosen.stderr
    assert json.loads(chosen.stdout)["selected"] == "toy"


def test_auto_prefers_the_plugin_over_cpu(plugins):
    # The toy plugin (priority 60) outranks cpu; an available in-tree accelerator (a GPU lane) outranks it.
    best_in_tree = max((p for p in default_registry().platforms.values() if p.available), key=lambda p: p.auto_priority)
    expected = best_in_tree.name if best_in_tree.auto_priority > 60 else "toy"
    listed = run_with([plugins["toy"]], "-m", "omnirun.cli", "env", "--json")
    assert json.loads(listed.stdout)["selected"] == expected


@pytest.mark.parametrize("version", [2, 1], ids=["as-shipped", "contract-v1-copy"])
def test_the_example_device_passes_the_installed_conformance_suite(tmp_path, version):
    """examples/omnirun-example-device, pip-installed as a vendor would, certified by the suite installed with
    omnirun (`python -m omnirun.conformance --report`), run from outside the repository; and a copy of it written
    for the previous contract version, which loads through shims with one deprecation warning."""
    example = tmp_path / "example"
    shutil.copytree(REPO / "examples" / "omnirun-example-device", example, ignore=shutil.ignore_patterns("build"))
    platform_file = example / "src" / "omnirun_example_device" / "platform.py"
    shipped = platform_file.read_text()
    assert "    api_version = 2\n" in shipped
    platform_file.write_text(shipped.replace("    api_version = 2\n", f"    api_version = {version}\n"))
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
         "--target", str(site), str(example)],
        check=True,
    )  # fmt: skip
    listed = run_with([site], "-m", "omnirun.cli", "env", "--device", "exampledev", "--json")
    assert listed.returncode == 0, listed.stderr
    row = json.loads(listed.stdout)["platforms"][0]
    assert row["name"] == "exampledev" and row["fused_ops"] == ["silu_and_mul"]
    warned = [line for line in listed.stderr.splitlines() if "OmnirunDeprecationWarning" in line]
    assert len(warned) == (1 if version == 1 else 0), listed.stderr
    if version == 1:
        assert "written for omnirun platform API version 1" in warned[0] and "move it to version 2" in warned[0]

    # The soaks (marked slow) run in the cpu lane's own pass over the suite. The version-1 copy differs only in its
    # hooks, which the shims translate: it takes the suite's files that read them (the as-shipped run takes all).
    report = tmp_path / "report.json"
    hooks = "platform_contract or runner_startup or attention_backends or memory_and_graphs"
    result = run_with(
        [site],
        *("-m", "omnirun.conformance", "--device", "exampledev", "--report", str(report), "-q", "-m", "not slow"),
        *(("-k", hooks) if version == 1 else ()),
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout[-3000:]
    assert " passed" in result.stdout and " failed" not in result.stdout
    certificate = json.loads(report.read_text())
    assert certificate["contract"] == {"omnirun": 2, "platform": version}
    assert certificate["summary"]["passed"] > 0 and "failed" not in certificate["summary"]


def test_broken_plugin_is_loud_and_never_replaced_by_cpu(plugins):
    table = run_with([plugins["broken"]], "-m", "omnirun.cli", "env")
    assert table.returncode == 0, table.stderr
    assert "broken: platform plugin 'broken' from omnirun-broken 0.1.0" in table.stdout
    assert "ImportError: libbroken.so: cannot open shared object file" in table.stdout

    auto = run_with([plugins["broken"]], "-m", "omnirun.cli", "env", "--device", "auto")
    assert auto.returncode != 0
    assert auto.stderr.count("\n") == 1 and "platform plugin 'broken'" in auto.stderr and "ImportError" in auto.stderr

    cpu = run_with([plugins["broken"]], "-m", "omnirun.cli", "env", "--device", "cpu")
    assert cpu.returncode == 0 and "platform plugin 'broken'" in cpu.stderr


def test_two_plugins_claiming_one_name_is_an_error(plugins):
    result = run_with([plugins["toy"], plugins["clone"]], "-m", "omnirun.cli", "env")
    assert result.returncode != 0
    assert "two packages register platform 'toy'" in result.stderr
    assert "omnirun-toy-plugin 0.1.0" in result.stderr and "omnirun-toy-clone 0.1.0" in result.stderr
