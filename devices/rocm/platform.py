"""The AMD platform: a ROCm build of torch drives the GPU through torch.cuda; RCCL for collectives, HIP graphs."""

from __future__ import annotations

import torch

from omnirun.devices.rocm.gfx_arch import GfxArch, fp8_dtypes, gfx_target, has_bf16
from omnirun.devices.torch_gpu import (
    gpu_model_dtypes,
    torch_cuda_graph_api,
    torch_gpu_build,
    triton_installed,
    visible_devices_note,
)
from omnirun.graphs import GraphAPI
from omnirun.platform import Capabilities, Platform, ProbeResult

# The HIP runtime honours all three; the first is the one to set.
VISIBILITY_ENVS = ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")


class RocmPlatform(Platform):
    api_version = 1
    name = "rocm"
    torch_device_type = "cuda"  # ROCm torch keeps the cuda device type and API
    visible_devices_env = VISIBILITY_ENVS[0]
    distributed_backend = "nccl"  # on a ROCm build torch's nccl backend is RCCL
    extra = "rocm"
    vendor_packages = ("triton",)
    auto_priority = 100

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

    def _capabilities(self) -> Capabilities:
        props = torch.cuda.get_device_properties(self.current_device())
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

    def graph_api(self) -> GraphAPI:
        return torch_cuda_graph_api()  # HIP graphs, behind torch.cuda
