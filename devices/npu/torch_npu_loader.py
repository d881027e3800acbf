"""Import torch_npu on first use, and turn each way that import fails into a one-line reason naming the fix.

`import torch_npu` is what makes an Ascend NPU reachable from torch: it renames torch's PrivateUse1 backend to
"npu" (so `torch.device("npu")` parses), registers `torch_npu.npu` as `torch.npu`, and registers the hccl
process-group backend. Its C extension links against the CANN toolkit (libascendcl.so, libhccl.so, ...), which
the loader finds only after CANN's set_env.sh has been sourced.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
from types import ModuleType

import torch

from omnirun.errors import DeviceUnavailableError

CANN_FIX = (
    "install the CANN toolkit and run `source /usr/local/Ascend/ascend-toolkit/set_env.sh` "
    "(or the set_env.sh of your CANN install) in the shell that starts omnirun"
)
# Libraries of the CANN toolkit and the Ascend driver that torch_npu's extension loads.
_CANN_LIBRARIES = ("libascendcl", "libhccl", "libascend_hal")


def load_torch_npu(install_hint: str) -> ModuleType:
    """The imported torch_npu module; raises DeviceUnavailableError with the reason when it cannot be imported."""
    if importlib.util.find_spec("torch_npu") is None:
        raise DeviceUnavailableError(
            "npu",
            f"torch-npu is not installed: {install_hint} (torch-npu pins the torch version it was built for, "
            "so let it choose torch)",
        )
    try:
        return importlib.import_module("torch_npu")
    except SystemExit:
        # torch-npu releases of the torch 2.1 era print the loader error and call sys.exit() when CANN is missing;
        # a probe must answer, not end the process.
        raise DeviceUnavailableError(
            "npu", f"import torch_npu called sys.exit() after printing its error: {CANN_FIX}"
        ) from None
    except Exception as exc:
        raise DeviceUnavailableError("npu", _import_failure_reason(exc)) from exc


def _import_failure_reason(exc: Exception) -> str:
    message = str(exc).strip()
    # torch_npu appends its own advice and an error-code line to the loader message; keep the loader's words.
    quoted = message.splitlines()[0].split(". Please ", 1)[0] if message else type(exc).__name__
    if any(library in message for library in _CANN_LIBRARIES):
        return f"import torch_npu failed ({quoted}): the CANN toolkit is missing or not on the loader path; {CANN_FIX}"
    if "undefined symbol" in message:
        return (
            f"import torch_npu failed ({quoted}): torch-npu {_version('torch-npu')} was built for another torch "
            f"than {torch.__version__}: install the torch version that this torch-npu pins"
        )
    return f"import torch_npu failed: {type(exc).__name__}: {quoted}"


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "(version unknown)"
