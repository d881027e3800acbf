"""The NVIDIA platform: torch.cuda for device control and memory, NCCL for collectives, CUDA graphs for decode."""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable
from typing import Any

import torch

from omnirun.attention.backend import HALF_DTYPES
from omnirun.device_shared.torch_gpu import (
    gpu_model_dtypes,
    torch_cuda_graph_api,
    torch_gpu_build,
    triton_installed,
    visible_devices_note,
)
from omnirun.facts import AttentionOffer, Capabilities, GraphAPI, ProbeResult
from omnirun.kernels import offers_triton
from omnirun.platform import Platform

# Compute capabilities (major, minor) where a feature starts.
BF16_MIN_SM = (8, 0)  # Ampere: bf16 tensor cores; older GPUs only emulate bf16, slowly
FP8_MIN_SM = (8, 9)  # Ada and Hopper: fp8 tensor cores
TRITON_MIN_SM = (7, 5)  # Turing: the oldest GPUs current triton releases still compile for
PDL_MIN_SM = (9, 0)  # Hopper: programmatic dependent launch (griddepcontrol)
# "0" launches the Triton kernels without programmatic dependent launch (to compare, or to rule it out).
PDL_ENV = "OMNIRUN_CUDA_PDL"

FLASHINFER = "flashinfer"


def flashinfer_installed() -> bool:
    """Whether flashinfer can be imported, found without importing it (it loads its JIT machinery on import)."""
    return importlib.util.find_spec("flashinfer") is not None


def _build_triton(context: Any, pdl: bool) -> Any:
    from omnirun.kernels.triton.attention_backend import TritonAttention  # imports triton: only when chosen

    # Three pipeline stages for the decode kernel's K/V loads: on an H200 they took up to 8 % less time than two in
    # 14 of the 15 cases swept (batches of 1-512 at 192-2,048 tokens; 0.4 % more at 512 x 192;
    # bench/results/h200_decode_tuning.json). The portable default stays at two, what fits AMD's 64 KiB of LDS.
    return TritonAttention(context, decode_num_stages=3, pdl=pdl)


def _build_flashinfer(context: Any) -> Any:
    from omnirun.devices.cuda.flashinfer_backend import FlashInferAttention  # imports flashinfer: only when chosen

    return FlashInferAttention(context)


class CudaPlatform(Platform):
    api_version = 2
    name = "cuda"
    torch_device_type = "cuda"
    visible_devices_env = "CUDA_VISIBLE_DEVICES"
    distributed_backend = "nccl"
    extra = "cuda"
    vendor_packages = ("triton", "flashinfer-python")
    auto_priority = 100

    def _probe(self) -> ProbeResult:
        build = torch_gpu_build()
        if build == "rocm":
            return ProbeResult.unavailable(
                f"torch {torch.__version__} is a ROCm build, which drives AMD GPUs: use --device rocm"
            )
        if build is None:
            return ProbeResult.unavailable(
                f"torch {torch.__version__} has no CUDA support: install a CUDA build of torch, "
                f"then {self.install_hint()}"
            )
        # device_count asks the driver (or NVML) and creates no CUDA context: torch.cuda stays uninitialised.
        count = torch.cuda.device_count()
        if count == 0:
            return ProbeResult.unavailable(
                f"no NVIDIA GPU is visible to torch {torch.__version__} (CUDA {torch.version.cuda}): "
                "check the driver with nvidia-smi" + visible_devices_note(self.visible_devices_env)
            )
        return ProbeResult.ok(count)

    def _capabilities(self) -> Capabilities:
        index = self.current_device()
        sm = tuple(torch.cuda.get_device_capability(index))
        has_fp8 = sm >= FP8_MIN_SM
        return Capabilities(
            device_name=torch.cuda.get_device_name(index),
            model_dtypes=gpu_model_dtypes(bf16=sm >= BF16_MIN_SM),
            fp8_e4m3_dtype=torch.float8_e4m3fn if has_fp8 else None,
            fp8_e5m2_dtype=torch.float8_e5m2 if has_fp8 else None,
            supports_triton=triton_installed() and sm >= TRITON_MIN_SM,
            async_execution=True,
        )

    def uses_pdl(self) -> bool:
        """Whether the Triton kernels launch with programmatic dependent launch: on Hopper and later, unless
        OMNIRUN_CUDA_PDL=0. Each kernel's launch then overlaps the end of the one before it."""
        if not offers_triton(self.capabilities) or os.environ.get(PDL_ENV, "1") == "0":
            return False
        if not torch.cuda.is_available():  # capabilities set by hand (tests): no device to ask
            return False
        return tuple(torch.cuda.get_device_capability(self.current_device())) >= PDL_MIN_SM

    def device_fused_ops(self) -> dict[str, Callable[..., Any]]:
        # The Triton GEMV for one-row matmuls and the one-launch argmax are cuda's own, not portable kernels:
        # measured on an H200 only, untried on ROCm and XPU (the argmax leans on int64 atomics). With PDL the
        # portable kernels are replaced by the same ones launched with it.
        if not offers_triton(self.capabilities):
            return {}
        from omnirun.devices.cuda.argmax import TritonArgmax  # imports triton
        from omnirun.devices.cuda.gemv import skinny_linear_ops
        from omnirun.kernels.triton.ops import triton_fused_ops

        pdl = self.uses_pdl()
        own = {**skinny_linear_ops(pdl=pdl), "argmax": TritonArgmax(pdl=pdl)}
        if self.capabilities.fp8:  # fp8 tensor cores and row-wise _scaled_mm: sm89 and later
            from omnirun.devices.cuda import fp8_linear

            own["fp8_linear"] = fp8_linear.fp8_linear
            own["fp8_linear_takes"] = fp8_linear.takes
        portable = triton_fused_ops(pdl=True, device_name=self.capabilities.device_name) if pdl else {}
        return {**portable, **own}

    def graph_api(self) -> GraphAPI:
        return torch_cuda_graph_api()

    def attention_offers(self) -> tuple[AttentionOffer, ...]:
        # triton tuned for NVIDIA GPUs in place of the portable build (same name: it stays the default).
        offers = []
        if offers_triton(self.capabilities):
            build = functools.partial(_build_triton, pdl=self.uses_pdl())
            offers.append(AttentionOffer("triton", build, batch_invariant=True))
        if flashinfer_installed():
            # Only on request until it is measured to beat triton (and it needs nvcc for its first kernels).
            offers.append(AttentionOffer(FLASHINFER, _build_flashinfer, dtypes=HALF_DTYPES, on_request=True))
        return tuple(offers)
