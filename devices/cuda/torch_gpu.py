"""Facts about torch's GPU build, shared by the cuda and rocm platforms: a ROCm torch runs behind the torch.cuda API."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from typing import Any, Literal

import torch


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


# Decode batches above this run eagerly: capturing more sizes costs start-up time and pool memory for little gain
# (at these sizes the GPU, not the launches, is the bottleneck).
MAX_GRAPH_BATCH_SIZE = 256


def triton_fused_ops_if_supported(supports_triton: bool) -> dict[str, Callable[..., Any]]:
    """The Triton kernels for rmsnorm, rotary and silu-and-mul where triton runs; else none (the references)."""
    if not supports_triton:
        return {}
    from omnirun.layers.triton_ops import triton_fused_ops  # imports triton: only once the device is chosen

    return triton_fused_ops()


def torch_cuda_graph_runner(runner: Any) -> Any:
    """Decode graphs through torch.cuda's graph API: CUDA graphs on NVIDIA, HIP graphs on AMD."""
    from omnirun.graphs import DecodeGraphRunner, GraphAPI

    api = GraphAPI(new_graph=torch.cuda.CUDAGraph, capture=torch.cuda.graph, new_pool=torch.cuda.graph_pool_handle)
    return DecodeGraphRunner(runner, api, max_batch_size=min(runner.max_running_requests, MAX_GRAPH_BATCH_SIZE))
