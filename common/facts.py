"""The facts a platform states about its device: whether it can be used (ProbeResult), what it can do
(Capabilities), how it captures graphs (GraphAPI), and the version of the contract it was written for.

A leaf: it imports nothing of omnirun's, so that what only needs facts (KV dtypes, model configs, kernel gates)
never imports the Platform class or anything the Platform builds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Literal

import torch

# The version of this contract. A platform sets `api_version` to the version it was written for (a literal, not
# this constant). Bump it when a hook changes meaning or signature, keep the previous version loading through shims
# (with one deprecation warning) for at least one more version, and record the change in docs/platform-contract.md.
PLATFORM_API_VERSION = 2
# The versions a plugin may be written for: this one, and the one before it through shims.
SUPPORTED_API_VERSIONS = (1, 2)

AttentionMode = Literal["prefill", "decode"]


@dataclasses.dataclass(frozen=True)
class ProbeResult:
    """Whether a device can be used here, and if not, why and how to fix it."""

    available: bool
    reason: str = ""
    device_count: int = 0

    @classmethod
    def ok(cls, device_count: int) -> ProbeResult:
        return cls(True, "", device_count)

    @classmethod
    def unavailable(cls, reason: str) -> ProbeResult:
        return cls(False, reason, 0)


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What the device can do. The runner reads these instead of asking which device it is on."""

    device_name: str
    # Model weight/activation dtypes the device computes in, best first.
    model_dtypes: tuple[torch.dtype, ...]
    # fp8 flavours for weights and KV cache; None where the device has no fp8.
    # (e4m3fn/e5m2 on NVIDIA and newer AMD, e4m3fnuz/e5m2fnuz on AMD gfx94x.)
    fp8_e4m3_dtype: torch.dtype | None
    fp8_e5m2_dtype: torch.dtype | None
    # Triton kernels compile and run on this device: the one gate for every kernel in omnirun.kernels.triton.
    supports_triton: bool
    # Kernels are queued and run while the host goes on (GPUs, NPUs): the engine then schedules the next step
    # while the device runs this one. False where ops finish before they return (the host CPU).
    async_execution: bool = False

    @property
    def bf16(self) -> bool:
        return torch.bfloat16 in self.model_dtypes

    @property
    def fp8(self) -> bool:
        return self.fp8_e4m3_dtype is not None

    @property
    def kv_cache_dtypes(self) -> tuple[torch.dtype, ...]:
        """Dtypes the paged KV cache can be stored in: the model dtypes plus the fp8 flavours."""
        fp8 = tuple(d for d in (self.fp8_e4m3_dtype, self.fp8_e5m2_dtype) if d is not None)
        return self.model_dtypes + fp8


@dataclasses.dataclass(frozen=True)
class GraphAPI:
    """How a device captures graphs: torch.cuda.CUDAGraph / torch.cuda.graph / torch.cuda.graph_pool_handle, or
    the same three of another device module. A platform's `graph_api()` returns one, or None for eager only."""

    name: str  # what `omnirun env` shows: "cuda_graph", "hip_graph", ...
    new_graph: Callable[[], Any]
    capture: Callable[..., AbstractContextManager]  # capture(graph, pool=...)
    new_pool: Callable[[], Any]


@dataclasses.dataclass(frozen=True)
class AttentionOffer:
    """An attention backend a platform offers, with its limits stated as data (contract version 2): the runner's
    assembly (omnirun.assembly) decides from these, and `omnirun env` reports them."""

    name: str  # what --attention-backend names
    build: Callable[[Any], Any]  # an omnirun.attention.AttentionContext -> the AttentionBackend
    # The model dtypes it computes in; None: every dtype the device computes in.
    dtypes: tuple[torch.dtype, ...] | None = None
    # Never a default: built only when the user names it (a backend not yet measured against the default).
    on_request: bool = False
    # Whether a decode step on it can be captured as a device graph: a flag, or a function of the model's head_dim
    # where that decides it. A backend may still refuse when built; the graph runner then runs eagerly.
    capturable: bool | Callable[[int], bool] = True
    # Whether it honours deterministic mode (AttentionContext.deterministic): then --deterministic may build it.
    batch_invariant: bool = False

    def serves(self, dtype: torch.dtype) -> bool:
        return self.dtypes is None or dtype in self.dtypes

    def capturable_for(self, head_dim: int | None) -> bool:
        """Capturable for a model of this head_dim (None: not known yet, e.g. in `omnirun env`: as far as known)."""
        if isinstance(self.capturable, bool):
            return self.capturable
        return True if head_dim is None else bool(self.capturable(head_dim))
