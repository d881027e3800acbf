"""The XPU platform: Intel GPUs through torch's own `torch.xpu` (torch >= 2.8), xccl for collectives.

intel-extension-for-pytorch is not used: every fact and control here comes from stock torch.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import torch

from omnirun.platform import Capabilities, Platform, ProbeResult

AFFINITY_MASK_ENV = "ZE_AFFINITY_MASK"


class XpuPlatform(Platform):
    api_version = 1
    name = "xpu"
    torch_device_type = "xpu"
    visible_devices_env = AFFINITY_MASK_ENV
    distributed_backend = "xccl"  # built into torch's XPU wheels since 2.8; replaces oneCCL's "ccl" binding
    extra = "xpu"
    vendor_packages = ("pytorch-triton-xpu",)
    auto_priority = 80

    def _probe(self) -> ProbeResult:
        if not _torch_has_xpu():
            return ProbeResult.unavailable(
                f"torch {torch.__version__} has no XPU support: install an XPU build of torch "
                f"(pip install torch --index-url https://download.pytorch.org/whl/xpu), then {self.install_hint()}"
            )
        # Never runs torch.xpu's lazy init. torch >= 2.13 counts through Level Zero Sysman when pyzes is
        # installed (fork-safe); otherwise the SYCL runtime enumerates devices, still without torch's XPU state.
        count = torch.xpu.device_count()
        if count == 0:
            return ProbeResult.unavailable(_no_device_reason())
        return ProbeResult.ok(count)

    def _capabilities(self) -> Capabilities:
        props = torch.xpu.get_device_properties(self.current_device())
        return Capabilities(
            device_name=props.name,
            model_dtypes=_model_dtypes(props),
            # torch stores and converts OCP fp8 (not the fnuz variants) on XPU; compute upcasts.
            fp8_e4m3_dtype=torch.float8_e4m3fn,
            fp8_e5m2_dtype=torch.float8_e5m2,
            supports_triton=_intel_triton_installed(),
            async_execution=True,
        )

    # No graph_api() yet: torch.xpu.XPUGraph (torch >= 2.11) could capture decode steps, but that path was never
    # run on an Intel GPU, so decode runs eagerly until it is tested there.

    def memory_info(self, index: int | None = None) -> tuple[int, int]:
        device = self.device(index)
        try:
            free, total = torch.xpu.mem_get_info(device)
        except RuntimeError:
            # Integrated GPUs cannot report free memory (SYCL's free_memory query is unsupported there). Their
            # memory is the host's: size from the driver's allocation limit minus what torch already holds.
            props = torch.xpu.get_device_properties(device)
            if not getattr(props, "is_integrated_gpu", False):
                raise
            total = props.total_memory
            free = total - torch.xpu.memory_reserved(device)
        return int(free), int(total)


def _torch_has_xpu() -> bool:
    """Whether this torch was built with XPU support: the flag torch.xpu itself reads, cheap and side-effect free."""
    return bool(getattr(torch._C, "_has_xpu", False))


def _no_device_reason() -> str:
    reason = (
        f"no Intel GPU is visible to torch {torch.__version__}: install the Intel GPU driver and the Level Zero "
        "runtime, and make sure this user can open /dev/dri/renderD*"
    )
    mask = os.environ.get(AFFINITY_MASK_ENV)
    if mask is not None:
        reason += f"; {AFFINITY_MASK_ENV}={mask!r} limits which devices are visible"
    return reason


def _model_dtypes(props: Any) -> tuple[torch.dtype, ...]:
    """Half-precision dtypes the device computes natively, best first; float32 always."""
    # torch.xpu.is_bf16_supported() counts emulated bf16 by default; only native conversions are worth using.
    native = ((torch.bfloat16, props.has_bfloat16_conversions), (torch.float16, props.has_fp16))
    return tuple(dtype for dtype, supported in native if supported) + (torch.float32,)


def _intel_triton_installed() -> bool:
    """Triton with Intel's backend (pytorch-triton-xpu), found on disk without importing triton.

    The generic `triton` wheel shares the import name but has no `backends/intel`, and cannot compile for XPU.
    """
    spec = importlib.util.find_spec("triton")
    if spec is None or not spec.submodule_search_locations:
        return False
    return any((Path(location) / "backends" / "intel").is_dir() for location in spec.submodule_search_locations)
