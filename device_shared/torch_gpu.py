"""Facts about torch's GPU build, shared by the cuda and rocm platforms: a ROCm torch runs behind the torch.cuda API.

It lives outside both device packages so that neither imports the other."""

from __future__ import annotations

import importlib.util
import os
from typing import TYPE_CHECKING, Literal

import torch

if TYPE_CHECKING:
    from omnirun.facts import GraphAPI


def torch_gpu_build() -> Literal["cuda", "rocm"] | None:
    """The GPU stack this torch was built for; None for a CPU-only build."""
    # A ROCm build sets torch.version.hip and leaves torch.version.cuda None; check hip first all the same.
    if torch.version.hip is not None:
        return "rocm"
    if torch.version.cuda is not None:
        return "cuda"
    return None


def visible_devices_note(*env_names: str) -> str:
    """A probe-reason suffix naming the visibility variables that are set (even empty), else ''."""
    settings = [f"{name}={os.environ[name]!r}" for name in env_names if name in os.environ]
    if not settings:
        return ""
    return f"; {', '.join(settings)} {'is' if len(settings) == 1 else 'are'} set (hiding every GPU not listed)"


def triton_installed() -> bool:
    """Whether triton can be imported, found without importing it (its import is slow and pulls in a compiler)."""
    return importlib.util.find_spec("triton") is not None


def gpu_model_dtypes(bf16: bool) -> tuple[torch.dtype, ...]:
    """Model dtypes best first: the half types run on the matrix cores, and bf16 keeps fp32's range."""
    halves = (torch.bfloat16, torch.float16) if bf16 else (torch.float16,)
    return halves + (torch.float32,)


def torch_cuda_graph_api() -> GraphAPI:
    """torch.cuda's graph API: CUDA graphs on NVIDIA, HIP graphs on AMD (named after the build, for reports)."""
    from omnirun.facts import GraphAPI

    name = "hip_graph" if torch_gpu_build() == "rocm" else "cuda_graph"
    cuda = torch.cuda
    return GraphAPI(name, new_graph=cuda.CUDAGraph, capture=cuda.graph, new_pool=cuda.graph_pool_handle)
