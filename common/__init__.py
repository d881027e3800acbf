"""omnirun: one LLM model runner, many accelerators.

Importing this package imports no vendor package (torch_npu, intel_extension_for_pytorch, flashinfer, aiter):
those are imported lazily, inside their device package, when that device is probed or used.
"""

from omnirun.errors import DeviceUnavailableError, OmnirunError
from omnirun.facts import Capabilities, ProbeResult
from omnirun.platform import Platform
from omnirun.registry import get_platform, select_platform


def __getattr__(name: str):
    # The engine pulls in transformers and the model code: load it on first use, so `import omnirun` stays light.
    if name in ("LLM", "SamplingParams"):
        from omnirun.engine import LLM
        from omnirun.sampling import SamplingParams

        return {"LLM": LLM, "SamplingParams": SamplingParams}[name]
    raise AttributeError(f"module 'omnirun' has no attribute {name!r}")


__version__ = "0.1.0"

__all__ = [
    "LLM",
    "SamplingParams",
    "Capabilities",
    "DeviceUnavailableError",
    "OmnirunError",
    "Platform",
    "ProbeResult",
    "get_platform",
    "select_platform",
]
