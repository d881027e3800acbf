"""The XPU platform: Intel GPUs through torch's own `torch.xpu` (torch >= 2.8), xccl for collectives.

Every fact and control comes from stock torch. Decode graphs use torch.xpu.XPUGraph where this torch has it
(torch >= 2.11). Where intel-extension-for-pytorch is installed *and* matches torch (IPEX X.Y needs torch X.Y), it
adds the `ipex` attention backend and IPEX's fused ops (device_shared/ipex_*.py, shared with the cpu platform),
`fused_moe` on IPEX's GatedMLPMOE (ipex_moe.py) where torch has no XPU graphs, and kept quantized weights where the
installed IPEX has the functions: `int4_linear` on its weight-only-quantized linear (ipex_int4.py; layers it cannot
take run the portable Triton kernel where triton runs, else the reference) and `fp8_linear` on its fp8 weight GEMM
(ipex_fp8.py; else the reference). IPEX's last release pins torch 2.10, which has no XPUGraph: on real installs IPEX
and XPU graphs never meet. Where Triton runs, IPEX or not, the portable Triton ops include `fp8_fused_moe`: fp8
experts stay in fp8 (omnirun.kernels.triton.ops.triton_fused_ops).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from omnirun.attention.backend import HALF_DTYPES
from omnirun.device_shared.ipex_support import IPEX, ipex_notes, ipex_status
from omnirun.facts import AttentionOffer, Capabilities, GraphAPI, ProbeResult
from omnirun.kernels import portable_fused_ops
from omnirun.platform import Platform

AFFINITY_MASK_ENV = "ZE_AFFINITY_MASK"


class XpuPlatform(Platform):
    api_version = 2
    name = "xpu"
    torch_device_type = "xpu"
    visible_devices_env = AFFINITY_MASK_ENV
    distributed_backend = "xccl"  # built into torch's XPU wheels since 2.8; replaces oneCCL's "ccl" binding
    extra = "xpu"
    vendor_packages = ("pytorch-triton-xpu", "intel-extension-for-pytorch")
    auto_priority = 80
    # ipex after triton (where triton runs) and before torch_native, the reference, which stays last.

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

    def _device_properties(self) -> Any:
        """torch's properties of the current device: name, fp16/bf16 support, integrated or not."""
        return torch.xpu.get_device_properties(self.current_device())

    def _capabilities(self) -> Capabilities:
        props = self._device_properties()
        return Capabilities(
            device_name=props.name,
            model_dtypes=_model_dtypes(props),
            # torch stores and converts OCP fp8 (not the fnuz variants) on XPU; compute upcasts.
            fp8_e4m3_dtype=torch.float8_e4m3fn,
            fp8_e5m2_dtype=torch.float8_e5m2,
            supports_triton=_intel_triton_installed(),
            async_execution=True,
        )

    # --- graphs ---
    def graph_api(self) -> GraphAPI | None:
        return xpu_graph_api(torch.xpu)

    # --- attention and fused ops ---
    def _ipex_usable(self) -> bool:
        return ipex_status("xpu").usable

    def attention_offers(self) -> tuple[AttentionOffer, ...]:
        # ipex only on request, as flashinfer on cuda and aiter on rocm: it has never run on an Intel GPU here, and
        # it computes in bf16/fp16 only. triton where pytorch-triton-xpu runs (torch's XPU wheels bring it), else
        # torch_native, is the default. IPEX pads head dims that are not a multiple of 64 through a host sync: no
        # graphs (and no graph memory out of the KV pool) for those.
        if not self._ipex_usable():
            return ()
        # imports no IPEX until a backend is built
        from omnirun.device_shared.ipex_attention import build_ipex_attention, graph_capturable

        capturable = functools.partial(graph_capturable, "xpu")
        return (AttentionOffer(IPEX, build_ipex_attention("xpu"), HALF_DTYPES, on_request=True, capturable=capturable),)

    def device_fused_ops(self) -> dict[str, Callable[..., Any]]:
        if not self._ipex_usable():
            return {}
        from omnirun.device_shared.ipex_ops import ipex_fused_ops  # imports IPEX
        from omnirun.devices.xpu.ipex_moe import ipex_moe_ops

        fallback = portable_fused_ops(self.capabilities)
        ops = ipex_fused_ops("xpu", fallback=fallback)
        ops.update(_ipex_quantized_linear_ops(fallback))
        # IPEX's MoE module reads each expert's row count on the host, and offering fused_moe turns decode graphs on
        # for MoE models: only where this torch has no XPU graphs (every real IPEX install: ipex_moe.py says why).
        if self.graph_api() is None:
            ops.update(ipex_moe_ops(fallback))
        return ops

    def notes(self) -> tuple[str, ...]:
        return ipex_notes("xpu")

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


def _ipex_quantized_linear_ops(fallback: Mapping[str, Callable[..., Any]]) -> dict[str, Callable[..., Any]]:
    """int4_linear / fp8_linear (with their prepare hooks) where the imported IPEX has the functions they call.
    Offering one makes layers keep those weights; what IPEX cannot take runs the fallback (ipex_int4.py, ipex_fp8.py).
    """
    import intel_extension_for_pytorch as ipex

    from omnirun.devices.xpu.ipex_fp8 import ipex_fp8_ops, offers_fp8
    from omnirun.devices.xpu.ipex_int4 import ipex_int4_ops, offers_int4

    ops = ipex_int4_ops(ipex, fallback) if offers_int4(ipex) else {}
    if offers_fp8():
        ops.update(ipex_fp8_ops(fallback))
    return ops


_GRAPH_API = ("XPUGraph", "graph", "graph_pool_handle")


def xpu_graph_api(module: Any) -> GraphAPI | None:
    """torch.xpu's graph API (`module`: torch.xpu, or a stand-in with the same three names), None where this torch
    lacks it. Gated on the attributes, not the version: XPUGraph arrived in torch 2.11 (pytorch issue #180168).
    torch.xpu.graph takes (xpu_graph, pool=None, stream=None), no capture_error_mode (torch/xpu/graphs.py)."""
    if not all(hasattr(module, name) for name in _GRAPH_API):
        return None
    return GraphAPI("xpu_graph", new_graph=module.XPUGraph, capture=module.graph, new_pool=module.graph_pool_handle)


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
