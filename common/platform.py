"""The Platform protocol: the facts a device answers and the parts it builds.

The device-neutral runner talks to a device only through a Platform. A device package subclasses `Platform`,
sets the identity attributes and `api_version`, implements `_probe()` and `_capabilities()`, and overrides a method
only where the generic implementation (built on `torch.get_device_module`) is wrong for its device.

A platform states facts and offers parts (`attention_offers()`, `device_fused_ops()`, `graph_api()`, a
communicator); it is never handed the runner. The runner's assembly (omnirun.assembly) chooses from the offers, and
`omnirun env` reports the same answers, never a separate label. docs/platform-contract.md lists every hook and the
version it came in; the hooks of contract version 1 below are shims for plugins written for it.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import torch

from omnirun.errors import DeviceUnavailableError

# The facts live in omnirun.facts; re-exported here, where plugins written for contract version 1 import them.
from omnirun.facts import (  # noqa: F401
    PLATFORM_API_VERSION,
    AttentionMode,
    AttentionOffer,
    Capabilities,
    GraphAPI,
    ProbeResult,
)


class Platform:
    """One accelerator family. Subclasses live in `devices/<name>/platform.py` or in out-of-tree plugins."""

    # --- identity (set by every subclass; the registry refuses a platform that lacks one) ---
    api_version: ClassVar[int]  # the PLATFORM_API_VERSION this platform was written for, as a literal
    name: ClassVar[str]  # what the user types: --device <name>
    torch_device_type: ClassVar[str]  # torch.device type: "cuda" for rocm too
    visible_devices_env: ClassVar[str | None] = None  # e.g. CUDA_VISIBLE_DEVICES
    distributed_backend: ClassVar[str]  # torch.distributed backend: nccl, hccl, xccl, gloo
    extra: ClassVar[str | None] = None  # pip extra that installs its vendor packages: omnirun[<extra>]
    vendor_packages: ClassVar[tuple[str, ...]] = ()  # distributions whose versions `omnirun env` reports
    # --device auto picks the available platform with the highest priority (ties: by name).
    auto_priority: ClassVar[int] = 50
    # Share of the device's total memory the runner may fill with weights + KV cache when the user names none:
    # the rest is left for activations, graph pools and other processes.
    default_mem_fraction_static: ClassVar[float] = 0.85
    # Decode batches above this run eagerly unless --max-graph-batch-size says otherwise: capturing more sizes
    # costs start-up time and pool memory (taken from the KV pool), and there the device, not the launches, is the
    # bottleneck (H200, 1,000 prompts of 256 -> 256 at 1,024 running: 15.0k output tok/s with graphs up to 1,024,
    # 15.7k with them up to 256; bench/results/h200_offline_bs1024_1000_graphs*.json).
    max_graph_batch_size: ClassVar[int] = 256

    @property
    def dispatch_key(self) -> str:
        """torch's dispatch key for this device's tensors, derived from `torch_device_type` (not typed by hand):
        the key of that name where torch has one (CUDA, XPU, CPU, ...), else PrivateUse1, the key out-of-tree
        backends such as torch_npu register under. omnirun itself never branches on it."""
        key = self.torch_device_type.upper()
        return key if hasattr(torch._C.DispatchKey, key) else "PrivateUse1"

    # --- availability ---
    def probe(self) -> ProbeResult:
        """Available, or the reason it is not. Cheap, never raises, and never initialises torch's state for the
        device: a driver may be asked to count devices, but no context is created and no memory is taken."""
        try:
            result = self._probe()
        except (Exception, SystemExit) as exc:  # a probe must answer, whatever the vendor stack does (some sys.exit)
            result = ProbeResult.unavailable(f"probing {self.name} raised {type(exc).__name__}: {exc}")
        # Reasons end up in one-line errors: fold any newline a vendor message brought along.
        return dataclasses.replace(result, reason=" ".join(result.reason.split()))

    def _probe(self) -> ProbeResult:
        raise NotImplementedError(f"{type(self).__name__} must implement _probe()")

    @property
    def available(self) -> bool:
        return self.probe().available

    def require_available(self) -> None:
        result = self.probe()
        if not result.available:
            raise DeviceUnavailableError(self.name, result.reason)

    def install_hint(self) -> str:
        """The pip command that brings this platform's vendor packages, for probe reasons."""
        return f'pip install "omnirun[{self.extra}]"' if self.extra else ""

    # --- capabilities ---
    @functools.cached_property
    def capabilities(self) -> Capabilities:
        """Of the current device (one device per process), computed once on first use; may initialise it."""
        self.require_available()
        return self._capabilities()

    def _capabilities(self) -> Capabilities:
        raise NotImplementedError(f"{type(self).__name__} must implement _capabilities()")

    # --- device control (generic: torch.get_device_module; override where the device differs) ---
    @property
    def device_module(self) -> Any:
        return torch.get_device_module(self.torch_device_type)

    def device(self, index: int | None = None) -> torch.device:
        return torch.device(self.torch_device_type, self.current_device() if index is None else index)

    def device_count(self) -> int:
        return self.probe().device_count

    def current_device(self) -> int:
        return self.device_module.current_device()

    def set_device(self, index: int) -> None:
        self.device_module.set_device(index)

    def synchronize(self, index: int | None = None) -> None:
        self.device_module.synchronize(index)

    def stream(self, index: int | None = None) -> torch.Stream:
        return self.device_module.Stream(self.device(index))

    def event(self, enable_timing: bool = False) -> torch.Event:
        return self.device_module.Event(enable_timing=enable_timing)

    def manual_seed(self, seed: int) -> None:
        """Seed the host generator and every device's (torch.manual_seed covers cuda, xpu and PrivateUse1 too)."""
        torch.manual_seed(seed)

    # --- memory: the inputs of KV-pool sizing ---
    def memory_info(self, index: int | None = None) -> tuple[int, int]:
        """(free, total) bytes of one device, as the device driver sees it (other processes included)."""
        free, total = self.device_module.mem_get_info(self.device(index))
        return int(free), int(total)

    def default_kv_cache_bytes(self) -> int | None:
        """A default KV pool size in bytes, for a device whose memory other work shares (the CPU's host memory);
        None: the pool is what mem_fraction_static of the device's memory allows, capped by what can use it."""
        return None

    def empty_cache(self) -> None:
        self.device_module.empty_cache()

    def peak_memory_allocated(self, index: int | None = None) -> int:
        return int(self.device_module.max_memory_allocated(self.device(index)))

    def reset_peak_memory(self, index: int | None = None) -> None:
        self.device_module.reset_peak_memory_stats(self.device(index))

    # --- graphs: one answer, read by the runner and by `omnirun env` alike ---
    def graph_api(self) -> GraphAPI | None:
        """How this device captures and replays graphs (`omnirun.facts.GraphAPI`), or None: decode runs eagerly.
        What `omnirun env` reports about graphs is this answer."""
        return None

    def make_graph_runner(self, runner: Any) -> Any | None:
        """Contract version 1 (deprecated: version 2 states graph limits on its attention offers and the runner
        builds the graph runner): the decode graph runner for `runner`, or None to run eagerly. A version-1
        platform with a further condition overrides this and calls super(), which returns what the runner's
        assembly (`omnirun.assembly`) plans."""
        return runner.planned_graph_runner()

    def decode_attention_backend(self, runner: Any) -> str:
        """Contract version 1 (deprecated): the decode backend `runner` builds, as its assembly chose it."""
        return runner.assembly.decode_attention

    # --- collectives ---
    def bind_rank(self, local_rank: int, ranks_per_node: int) -> int:
        """The device index of the rank `local_rank` of `ranks_per_node` on this node: one device per rank by
        default. Platforms whose ranks share one device (the CPU) return 0 and divide it among them."""
        return local_rank

    def unbind_rank(self) -> None:
        """Undo `bind_rank` when this process's rank closes (the process may run a single-device runner next)."""

    def make_communicator(self, group: Any = None) -> Any:
        """The collective communicator for `group` (None: the default group): an `omnirun.distributed.Communicator`
        over torch.distributed on `distributed_backend`. A platform may return a faster subclass (a custom
        all-reduce). The runner builds one for its tensor-parallel group; no in-tree platform overrides it yet."""
        from omnirun.distributed.communicator import Communicator

        return Communicator(group)

    # --- fused ops ---
    def fused_ops(self) -> Mapping[str, Callable[..., Any]]:
        """Fused kernels by op name (rms_norm, rotary_embedding, silu_and_mul, ...) overriding the torch-native
        references: the portable kernels the capabilities allow (`omnirun.kernels`), then the device's own."""
        from omnirun.kernels import portable_fused_ops

        return {**portable_fused_ops(self.capabilities), **self.device_fused_ops()}

    def device_fused_ops(self) -> Mapping[str, Callable[..., Any]]:
        """This device's own fused ops by op name; they replace a portable kernel of the same name."""
        return {}

    # --- attention ---
    def attention_offers(self) -> tuple[AttentionOffer, ...]:
        """This device's own attention backends, best first, each with its limits as data (contract version 2):
        flashinfer, aiter, ascend, ipex, or a tuned build of a portable one under the same name. They join the
        portable backends (omnirun.attention.registry). The default derives them from a version-1 platform's
        `attention_backend_factories()`."""
        from omnirun.attention.registry import offer_from_factory

        return tuple(offer_from_factory(name, f) for name, f in self.attention_backend_factories().items())

    def attention_backend_factories(self) -> Mapping[str, Callable[..., Any]]:
        """Contract version 1 (deprecated; version 2 overrides `attention_offers`): this device's own backends by
        name, classes or callables taking an `omnirun.attention.AttentionContext`."""
        return {}

    def all_attention_offers(self) -> tuple[AttentionOffer, ...]:
        """Every backend a run may build here, best first: the device's own that may be a default, the portable GPU
        ones (triton), the device's own built only on request, torch_native (runs everywhere), and batch_invariant
        (device-neutral, for --deterministic where nothing faster is batch-invariant)."""
        from omnirun.attention.registry import with_portable_offers

        return with_portable_offers(self.attention_offers(), self.capabilities)

    def attention_offer(self, name: str) -> AttentionOffer | None:
        return next((offer for offer in self.all_attention_offers() if offer.name == name), None)

    def attention_backends(self) -> tuple[str, ...]:
        """The backends a user may name here, best first (batch_invariant only with --deterministic)."""
        from omnirun.attention.registry import BATCH_INVARIANT_OFFER

        return tuple(o.name for o in self.all_attention_offers() if o is not BATCH_INVARIANT_OFFER)

    def deterministic_attention_backends(self) -> tuple[str, ...]:
        """What --deterministic may build, best first: the offers that are batch-invariant, batch_invariant last."""
        return tuple(offer.name for offer in self.all_attention_offers() if offer.batch_invariant)

    def default_attention_backend_for(self, mode: AttentionMode, model_dtype: torch.dtype) -> str:
        """The backend built for prefill or decode when the user names none: the best offer that is not on request
        and computes in `model_dtype`. A version-1 platform's `default_attention_backend` override still decides."""
        if type(self).default_attention_backend is not Platform.default_attention_backend:  # contract version 1
            return self.default_attention_backend(mode)
        from omnirun.attention.registry import BATCH_INVARIANT_OFFER

        offers = self.all_attention_offers()
        return next(
            o.name for o in offers if o is not BATCH_INVARIANT_OFFER and not o.on_request and o.serves(model_dtype)
        )

    def default_attention_backend(self, mode: AttentionMode) -> str:
        """Contract version 1 (deprecated): the dtype-blind default; version 2 derives it from the offers."""
        return self.default_attention_backend_for(mode, self.capabilities.model_dtypes[0])

    # --- report ---
    def notes(self) -> tuple[str, ...]:
        """One line per vendor part this platform falls back from and why (an installed package it cannot use),
        for `omnirun env`; empty when there is nothing to explain."""
        return ()

    def package_versions(self) -> dict[str, str | None]:
        """Installed version of each vendor distribution (None: not installed), read without importing it."""
        return {dist: _installed_version(dist) for dist in self.vendor_packages}

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


def _installed_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None
