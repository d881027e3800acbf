"""omnirun: one LLM model runner, many accelerators.

Importing this package imports no vendor package (torch_npu, intel_extension_for_pytorch, flashinfer, aiter):
those are imported lazily, inside their device package, when that device is probed or used.
"""

from omnirun.errors import DeviceUnavailableError, OmnirunError
from omnirun.platform import Capabilities, Platform, ProbeResult
from omnirun.registry import get_platform, select_platform

__version__ = "0.1.0"

__all__ = [
    "Capabilities",
    "DeviceUnavailableError",
    "OmnirunError",
    "Platform",
    "ProbeResult",
    "get_platform",
    "select_platform",
]
