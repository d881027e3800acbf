"""Importing omnirun and the xpu platform, and probing it, pulls in no vendor package (fresh interpreter)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import torch

CHECK = textwrap.dedent(
    """
    import sys
    import omnirun
    import omnirun.registry
    from omnirun.devices.xpu.platform import XpuPlatform

    platform = XpuPlatform()
    platform.probe()
    versions = platform.package_versions()
    # the look-alikes are visible to this interpreter, so the check below is not vacuous
    assert all(versions.values()), versions
    loaded = sorted(m for m in ("intel_extension_for_pytorch", "triton") if m in sys.modules)
    print("loaded:", loaded)
    """
)


def test_import_and_probe_load_no_vendor_package(tmp_path, write_package) -> None:
    # Installable look-alikes, so an accidental import would succeed and show up in sys.modules.
    torch_minor = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    write_package(tmp_path, "intel_extension_for_pytorch", "intel-extension-for-pytorch", f"{torch_minor}.10+xpu")
    write_package(tmp_path, "triton", "pytorch-triton-xpu", "3.6.0", subdirs=("backends/intel",))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run(
        [sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    assert "loaded: []" in result.stdout
