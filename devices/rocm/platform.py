"""The AMD platform: a ROCm build of torch drives the GPU through torch.cuda; RCCL for collectives, HIP graphs.

Where amd-aiter is installed it adds AMD's own parts: the `aiter` attention backend (offered next to triton),
aiter's rms norms as fused ops (in place of triton's, which stay the fallback aiter does not cover), and on CDNA GPUs
with fp8 (MI300, MI350) `fp8_linear` on aiter's W8A8 GEMMs, so that fp8 checkpoints keep their fp8 weights. Where
Triton runs on a GPU with fp8, fp8 experts stay in fp8 on the portable Triton `fp8_fused_moe` (read as e4m3fnuz on
an MI300: omnirun.kernels.triton.ops.triton_fused_ops), aiter or not.
"""

from __future__ import annotations

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
from omnirun.devices.rocm.aiter_moe import AITER_MOE_ENV
from omnirun.devices.rocm.gfx_arch import GfxArch, fp8_dtypes, gfx_target, has_bf16
from omnirun.facts import AttentionOffer, Capabilities, GraphAPI, ProbeResult
from omnirun.kernels import offers_triton, portable_fused_ops
from omnirun.platform import Platform

# The HIP runtime honours all three; the first is the one to set.
VISIBILITY_ENVS = ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")

AITER = "aiter"


def aiter_installed() -> bool:
    """Whether aiter can be imported, found without importing it (its import loads JIT machinery and triton)."""
    return importlib.util.find_spec("aiter") is not None


def _build_aiter(context: Any) -> Any:
    from omnirun.devices.rocm.aiter_attention import AiterAttention  # imports aiter: only when chosen

    return AiterAttention(context)


class RocmPlatform(Platform):
    api_version = 2
    name = "rocm"
    torch_device_type = "cuda"  # ROCm torch keeps the cuda device type and API
    visible_devices_env = VISIBILITY_ENVS[0]
    distributed_backend = "nccl"  # on a ROCm build torch's nccl backend is RCCL
    extra = "rocm"
    vendor_packages = ("triton", "amd-aiter")
    auto_priority = 100
    # aiter after triton: it computes in bf16/fp16 only, and has never been measured against triton (nor run on an
    # AMD GPU by this project). torch_native last.

    def _probe(self) -> ProbeResult:
        build = torch_gpu_build()
        if build == "cuda":
            return ProbeResult.unavailable(
                f"torch {torch.__version__} is a CUDA build, which drives NVIDIA GPUs: use --device cuda"
            )
        if build is None:
            return ProbeResult.unavailable(
                f"torch {torch.__version__} has no ROCm support: install a ROCm build of torch, "
                f"then {self.install_hint()}"
            )
        # device_count creates no HIP context: torch.cuda stays uninitialised.
        count = torch.cuda.device_count()
        if count == 0:
            return ProbeResult.unavailable(
                f"no AMD GPU is visible to torch {torch.__version__} (HIP {torch.version.hip}): "
                "check the amdgpu driver and access to /dev/kfd with rocm-smi" + visible_devices_note(*VISIBILITY_ENVS)
            )
        return ProbeResult.ok(count)

    def _device_properties(self) -> Any:
        """torch's properties of the current GPU: its marketing name and gcnArchName."""
        return torch.cuda.get_device_properties(self.current_device())

    def _capabilities(self) -> Capabilities:
        props = self._device_properties()
        arch = GfxArch.parse(props.gcnArchName)
        fp8_e4m3, fp8_e5m2 = fp8_dtypes(arch)
        return Capabilities(
            # Marketing names can be generic ("AMD Radeon Graphics"); the gfx target says which chip it is.
            device_name=f"{props.name} ({gfx_target(props.gcnArchName)})",
            model_dtypes=gpu_model_dtypes(bf16=has_bf16(arch)),
            fp8_e4m3_dtype=fp8_e4m3,
            fp8_e5m2_dtype=fp8_e5m2,
            supports_triton=triton_installed(),
            async_execution=True,
        )

    def aiter_moe_requested(self) -> bool:
        """Whether aiter's fused MoE replaces the Triton one: only with OMNIRUN_ROCM_AITER_MOE=1 (aiter_moe.py)."""
        return os.environ.get(AITER_MOE_ENV) == "1"

    def notes(self) -> tuple[str, ...]:
        if aiter_installed() and not self.aiter_moe_requested():
            return (f"aiter's fused_moe only on request ({AITER_MOE_ENV}=1): not yet measured against Triton's",)
        return ()

    def graph_api(self) -> GraphAPI:
        return torch_cuda_graph_api()  # HIP graphs, behind torch.cuda

    def attention_offers(self) -> tuple[AttentionOffer, ...]:
        # aiter only on request, as in vLLM (VLLM_ROCM_USE_AITER) and SGLang (SGLANG_USE_AITER): triton where it
        # runs, else torch_native, is the default. It stays on request until it is measured on an MI300 against
        # triton (FakeRocmPlatform offers it as the default for half dtypes).
        if not aiter_installed():
            return ()
        return (AttentionOffer(AITER, _build_aiter, dtypes=HALF_DTYPES, on_request=True),)

    def device_fused_ops(self) -> dict[str, Callable[..., Any]]:
        if not aiter_installed():
            return {}
        import aiter

        from omnirun.devices.rocm.aiter_fp8 import aiter_fp8_ops
        from omnirun.devices.rocm.aiter_ops import aiter_norm_ops

        caps = self.capabilities
        portable = portable_fused_ops(caps)
        ops = aiter_norm_ops(fallback=portable)
        # aiter's fused MoE only on request, and only over a graph-safe portable fused_moe (Triton's) for what it
        # hands back: the reference picks experts on the host, which a captured decode step cannot hold.
        if self.aiter_moe_requested() and "fused_moe" in portable:
            from omnirun.devices.rocm.aiter_moe import aiter_fused_moe
            from omnirun.kernels.triton.moe import route

            ops["fused_moe"] = aiter_fused_moe(aiter, portable["fused_moe"], route)
        # aiter's CK fp8 GEMMs ship code for CDNA (gfx9) only: RDNA4 has fp8 but aiter sends it to Triton kernels
        # of its own (ROCm/aiter:aiter/ops/gemm_op_a8w8.py, _ck_a8w8_supported), which omnirun has not wired.
        if caps.fp8_e4m3_dtype is not None and GfxArch.parse(self._device_properties().gcnArchName).major == 9:
            ops.update(aiter_fp8_ops(aiter, caps.fp8_e4m3_dtype, triton=offers_triton(caps)))
        return ops
