"""Whether intel-extension-for-pytorch (IPEX) can be used here, found without importing it.

Shared by the xpu and cpu platforms. IPEX X.Y works only beside torch X.Y: its `__init__` compares the two
major.minor versions and calls os._exit(127) on a mismatch (intel/intel-extension-for-pytorch@v2.8.10+xpu:
intel_extension_for_pytorch/__init__.py), so importing a mismatched IPEX would kill the process. The check here
reads the installed distribution's version instead. IPEX ships separate builds: "+xpu" wheels for Intel GPUs
(2.8.10+xpu) and CPU wheels (2.8.0+cpu, or 2.8.0 on PyPI); each platform needs its own.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import re
from typing import Literal

import torch

IMPORT_NAME = "intel_extension_for_pytorch"
DISTRIBUTION = "intel-extension-for-pytorch"
IPEX = "ipex"  # the attention backend's name, and the prefix of the reasons below

Build = Literal["xpu", "cpu"]


@dataclasses.dataclass(frozen=True)
class IpexStatus:
    usable: bool
    version: str | None  # the installed distribution's version; None when not installed
    reason: str  # why not usable ("" when usable, or when not installed at all: nothing to explain)


def major_minor(version: str) -> str | None:
    """ "2.8" of "2.8.10+xpu": the part IPEX compares (the same pattern as its __init__)."""
    match = re.match(r"(\d+\.\d+)", version)
    return match.group(1) if match else None


def build_of(version: str) -> Build:
    """The build a version names: the XPU wheels carry a "+xpu" local label, every other build is for the CPU."""
    return "xpu" if version.partition("+")[2].startswith("xpu") else "cpu"


def ipex_status(build: Build, torch_version: str | None = None) -> IpexStatus:
    """Whether this platform (`build`: "xpu" or "cpu") may import IPEX, and if not, why (for `omnirun env`)."""
    torch_version = torch_version or torch.__version__
    if importlib.util.find_spec(IMPORT_NAME) is None:
        return IpexStatus(False, None, "")
    try:
        version = importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        reason = f"{IPEX}: {IMPORT_NAME} is importable but not installed as {DISTRIBUTION}: reinstall it with pip"
        return IpexStatus(False, None, reason)
    wanted, found = major_minor(version), major_minor(torch_version)
    if wanted is None or wanted != found:
        return IpexStatus(
            False, version, f"{IPEX}: {DISTRIBUTION} {version} needs torch {wanted}, found {found or torch_version}"
        )
    if build_of(version) != build:
        return IpexStatus(
            False,
            version,
            f"{IPEX}: {DISTRIBUTION} {version} is a {build_of(version).upper()} build; the {build} platform needs "
            f"its {build.upper()} build",
        )
    return IpexStatus(True, version, "")


def ipex_notes(build: Build) -> tuple[str, ...]:
    """The line `omnirun env` shows when IPEX is installed but cannot be used by this platform."""
    status = ipex_status(build)
    return (status.reason,) if status.reason else ()
