"""intel-extension-for-pytorch, shared by the cpu and xpu platforms: optional, used only when it matches torch.

IPEX releases are built against one torch minor version (2.8.* at the time of writing) and fail or misbehave
beside any other, so omnirun imports it only when its major.minor equals torch's, and never requires it.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import logging

import torch

DISTRIBUTION = "intel-extension-for-pytorch"

logger = logging.getLogger(__name__)


def _minor(version: str) -> tuple[str, ...]:
    return tuple(version.split("+")[0].split(".")[:2])


def ipex_status() -> tuple[bool, str]:
    """(usable, why): whether IPEX is installed and matches this torch. Reads metadata only, imports nothing."""
    if importlib.util.find_spec("intel_extension_for_pytorch") is None:
        return False, "intel-extension-for-pytorch is not installed (optional)"
    try:
        version = importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return False, "intel_extension_for_pytorch is importable but has no package metadata; not used"
    if _minor(version) != _minor(torch.__version__):
        return False, f"intel-extension-for-pytorch {version} does not match torch {torch.__version__}; not used"
    return True, f"intel-extension-for-pytorch {version}"


@functools.cache
def load_ipex():
    """The imported IPEX module when usable, else None. Imported lazily, on first use by a platform."""
    usable, _ = ipex_status()
    if not usable:
        return None
    try:
        return importlib.import_module("intel_extension_for_pytorch")
    except (ImportError, OSError) as exc:  # e.g. a oneAPI runtime library missing despite matching versions
        logger.warning("intel-extension-for-pytorch failed to import, running without it: %s", exc)
        return None
