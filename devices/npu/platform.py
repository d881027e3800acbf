"""The NPU platform: Huawei Ascend NPUs through torch_npu (CANN), hccl for collectives.

torch_npu is imported on first use, never at `import omnirun`: once imported it is `torch.npu`, whose API mirrors
`torch.cuda`, so the generic Platform methods (built on `torch.get_device_module`) serve every device control and
memory query unchanged; this class only makes sure torch_npu is loaded before any of them runs.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from omnirun.attention.backend import HALF_DTYPES
from omnirun.devices.npu.torch_npu_loader import load_torch_npu
from omnirun.errors import DeviceUnavailableError
from omnirun.facts import AttentionOffer, Capabilities, ProbeResult
from omnirun.platform import Platform

ASCEND = "ascend"
TORCH_NATIVE = "torch_native"  # the reference backend, and the default for float32 models
# The ATB operators the ascend backend calls (registered under torch.ops.atb once NNAL's libatb.so loads).
ATB_OPS = ("_npu_reshape_and_cache", "_npu_paged_attention", "_npu_flash_attention_qlens")


def atb_op_registered(name: str) -> bool:
    """Whether torch_npu's ATB library (NNAL's libatb.so) registered the operator: torch_npu.<name> exists either
    way, as a lazy stub that raises (Ascend/op-plugin:op_plugin/python/atb/_atb_ops.py)."""
    return hasattr(torch.ops.atb, name)


def _build_ascend(context: Any) -> Any:
    from omnirun.devices.npu.ascend_attention import AscendAttention  # imports torch_npu: only when chosen

    return AscendAttention(context)


VISIBLE_DEVICES_ENV = "ASCEND_RT_VISIBLE_DEVICES"
# What the kept int4 layers run (omnirun.devices.npu.ascend_quant): the kernel's limits, said where `omnirun env` shows.
INT4_NOTE = (
    "int4 layers run npu_weight_quant_batchmatmul in bf16/fp16 models, for groups of a multiple of 32 inputs or one "
    "per row; other int4 layers (float32 models, groups of 16) are dequantized at load"
)
# What kept int4 experts run (omnirun.devices.npu.ascend_moe_int4).
INT4_MOE_NOTE = (
    "int4 experts run npu_grouped_matmul's antiquant mode in bf16/fp16 models, the loaded words waiting in host "
    "memory beside the kernel's; experts whose groups do not divide their inputs run the reference, and so do "
    "float32 models, copying the loaded words over at each call"
)


class NpuPlatform(Platform):
    api_version = 2
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

    def _soc(self) -> tuple[str, bool]:
        """The SoC name of the current device ("Ascend910B3", "Ascend950PR_9579", ...) and whether it has bf16."""
        npu = self.device_module
        return npu.get_device_name(self.current_device()), npu.is_bf16_supported()

    def _capabilities(self) -> Capabilities:
        device_name, bf16 = self._soc()
        fp8 = _has_fp8(device_name)
        return Capabilities(
            device_name=device_name,
            # Atlas A2/A3 (910B, 910_93) compute in bf16; Atlas 300I/310P cards only in fp16.
            model_dtypes=(torch.bfloat16, torch.float16, torch.float32) if bf16 else (torch.float16, torch.float32),
            fp8_e4m3_dtype=torch.float8_e4m3fn if fp8 else None,
            fp8_e5m2_dtype=torch.float8_e5m2 if fp8 else None,
            # common/'s Triton kernels target CUDA, ROCm and XPU; Ascend's Triton is the separate triton-ascend
            # compiler, and its kernels would live in this package.
            supports_triton=False,
            async_execution=True,
        )

    # --- the parts torch_npu brings ---
    def _torch_npu(self) -> ModuleType | None:
        try:
            return load_torch_npu(self.install_hint())
        except DeviceUnavailableError:
            return None

    def _ascend_missing(self) -> str | None:
        """Why the ascend attention backend cannot run here, or None when it can."""
        torch_npu = self._torch_npu()
        if torch_npu is None:
            return "torch-npu does not import"
        missing = [op for op in ATB_OPS if not atb_op_registered(op)]
        if missing:
            return (
                f"torch_npu registers no ATB operator {missing[0]}: install the CANN NNAL package and source its "
                "set_env.sh (/usr/local/Ascend/nnal/atb/set_env.sh)"
            )
        return None

    def attention_offers(self) -> tuple[AttentionOffer, ...]:
        # ascend (ATB) is the default for bf16/fp16 models, as vllm-ascend and SGLang run on Ascend; float32 runs
        # torch_native.
        if self._ascend_missing() is not None:
            return ()
        return (AttentionOffer(ASCEND, _build_ascend, dtypes=HALF_DTYPES),)

    def graph_api(self) -> Any:
        # NPU graphs only where a decode step can be captured: on the ascend backend (torch_native reads lengths on
        # the host). Never run on an Ascend device by this project.
        torch_npu = self._torch_npu()
        if torch_npu is None or self._ascend_missing() is not None or not hasattr(torch_npu.npu, "NPUGraph"):
            return None
        from omnirun.devices.npu.npu_graphs import npu_graph_api

        return npu_graph_api(torch_npu)

    def device_fused_ops(self) -> dict[str, Callable[..., Any]]:
        torch_npu = self._torch_npu()
        if torch_npu is None:
            return {}
        from omnirun.devices.npu.ascend_moe_int4 import ascend_int4_moe_ops
        from omnirun.devices.npu.ascend_ops import ascend_fused_ops
        from omnirun.devices.npu.ascend_quant import ascend_int4_ops

        # The int4 kernels depend on the SoC, which only an available device names.
        soc = self.capabilities.device_name if self.probe().available else ""
        int4 = {**ascend_int4_ops(torch_npu, soc), **ascend_int4_moe_ops(torch_npu, soc)}
        return {**ascend_fused_ops(torch_npu), **int4}

    def notes(self) -> tuple[str, ...]:
        if not self.probe().available:
            return ()  # the probe's reason says why
        missing = self._ascend_missing()
        if missing is not None:
            notes = [f"no ascend attention and no NPU graphs: {missing}"]
        else:
            notes = ["ascend attention and NPU graphs for bf16/fp16 models; float32 runs torch_native, eagerly"]
        ops = self.device_fused_ops()
        if "int4_linear" in ops:
            notes.append(INT4_NOTE)
        if "int4_fused_moe" in ops:
            notes.append(INT4_MOE_NOTE)
        return tuple(notes)

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
