"""The NPU platform: Huawei Ascend NPUs through torch_npu (CANN), hccl for collectives.

torch_npu is imported on first use, never at `import omnirun`: once imported it is `torch.npu`, whose API mirrors
`torch.cuda`, so the generic Platform methods (built on `torch.get_device_module`) serve every device control and
memory query unchanged; this class only makes sure torch_npu is loaded before any of them runs.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from omnirun.devices.npu.torch_npu_loader import load_torch_npu
from omnirun.errors import DeviceUnavailableError
from omnirun.platform import Capabilities, Platform, ProbeResult

VISIBLE_DEVICES_ENV = "ASCEND_RT_VISIBLE_DEVICES"


class NpuPlatform(Platform):
    api_version = 1
    name = "npu"
    torch_device_type = "npu"
    visible_devices_env = VISIBLE_DEVICES_ENV
    distributed_backend = "hccl"  # registered with torch.distributed by `import torch_npu`
    extra = "npu"
    vendor_packages = ("torch-npu",)
    auto_priority = 90

    def _probe(self) -> ProbeResult:
        try:
            npu = self.device_module
        except DeviceUnavailableError as exc:
            return ProbeResult.unavailable(exc.reason)
        # Counts through the driver (ascend_hal), honouring ASCEND_RT_VISIBLE_DEVICES, without initialising a device.
        count = npu.device_count()
        if count == 0:
            return ProbeResult.unavailable(_no_device_reason())
        return ProbeResult.ok(count)

    def _capabilities(self) -> Capabilities:
        npu = self.device_module
        device_name = npu.get_device_name(self.current_device())  # the SoC: "Ascend910B3", "Ascend950PR_9579", ...
        fp8 = _has_fp8(device_name)
        return Capabilities(
            device_name=device_name,
            # Atlas A2/A3 (910B, 910_93) compute in bf16; Atlas 300I/310P cards only in fp16.
            model_dtypes=(torch.bfloat16, torch.float16, torch.float32)
            if npu.is_bf16_supported()
            else (torch.float16, torch.float32),
            fp8_e4m3_dtype=torch.float8_e4m3fn if fp8 else None,
            fp8_e5m2_dtype=torch.float8_e5m2 if fp8 else None,
            # common/'s Triton kernels target CUDA, ROCm and XPU; Ascend's Triton is the separate triton-ascend
            # compiler, and its kernels would live in this package.
            supports_triton=False,
            async_execution=True,
        )

    # No graph_api() yet: torch.npu.NPUGraph mirrors torch.cuda.CUDAGraph, but no NPU attention backend here can
    # run inside a graph and the capture was never tried on an Ascend device, so decode runs eagerly.

    @property
    def device_module(self) -> Any:
        # torch.get_device_module("npu") resolves only after `import torch_npu` registered torch.npu.
        load_torch_npu(self.install_hint())
        return torch.get_device_module(self.torch_device_type)

    def device(self, index: int | None = None) -> torch.device:
        # torch.device("npu", i) parses only after `import torch_npu` renamed PrivateUse1 to "npu".
        load_torch_npu(self.install_hint())
        return super().device(index)


def _has_fp8(device_name: str) -> bool:
    """fp8 (e4m3fn, e5m2) storage and matmul arrived with Ascend 950 (Atlas 350); Atlas A2/A3 have none."""
    return device_name.startswith("Ascend950")


def _no_device_reason() -> str:
    reason = "torch_npu loaded but sees no Ascend NPU: check the driver and the devices with `npu-smi info`"
    visible = os.environ.get(VISIBLE_DEVICES_ENV)
    if visible is not None:
        reason += f"; {VISIBLE_DEVICES_ENV}={visible!r} limits which devices this process sees"
    return reason
