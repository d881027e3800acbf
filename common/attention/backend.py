"""The attention backend interface: what the runner and a graph runner ask of every backend.

A backend owns the per-batch metadata (computed once per forward, shared by all layers), stores each layer's new
K/V into the paged pool, and computes attention over a request's cached tokens. Layers call `forward`; the runner
calls `init_forward_metadata` before the model runs. Backends that can run inside a captured graph set
`supports_graph` and implement the three graph hooks, which keep their metadata in static buffers.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from omnirun.batch import ForwardBatch, ForwardMode
from omnirun.errors import ConfigError
from omnirun.memory import KVMemory

# What device kernels that compute in half precision only (flashinfer, aiter, ATB, IPEX on xpu) accept.
HALF_DTYPES = (torch.bfloat16, torch.float16)


@dataclasses.dataclass(frozen=True)
class AttentionContext:
    """What a backend is built from: the KV memory it reads and writes, and the model's attention shape."""

    kv: KVMemory
    device: torch.device
    model_dtype: torch.dtype
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_context_len: int
    # Deterministic inference: a backend that declares `batch_invariant` must then compute each query the same
    # way whatever else is in the batch, however its prefill was chunked and whether its prefix came from cache.
    deterministic: bool = False


def require_half_precision(context: AttentionContext, backend: str, kernels: str = "") -> None:
    """Refuse, in one line naming the fix, a model dtype a half-precision-only backend cannot compute in."""
    if context.model_dtype not in HALF_DTYPES:
        dtype = str(context.model_dtype).removeprefix("torch.")
        raise ConfigError(
            f"the {backend} attention backend computes in bfloat16 or float16{kernels}, not {dtype}: pass --dtype "
            "bfloat16, or choose another --attention-backend"
        )


def require_grouped_heads(context: AttentionContext) -> None:
    """Refuse query heads that do not fall into equal groups over the KV heads (what every GQA kernel assumes)."""
    if context.num_heads % context.num_kv_heads:
        raise ConfigError(
            f"{context.num_heads} query heads do not group over {context.num_kv_heads} KV heads: the model's "
            "num_attention_heads must be a multiple of num_key_value_heads"
        )


@dataclasses.dataclass(frozen=True)
class AttentionLayerSpec:
    """One attention layer as a backend sees it."""

    layer_id: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float
    # Keys older than this many positions are masked (a query sees itself and the window - 1 before it).
    sliding_window: int | None = None


@dataclasses.dataclass(frozen=True)
class Rotary:
    """A layer's rotary embedding, handed to the backend unapplied so that a backend may fuse it into its KV store
    (one kernel where two ran); every other backend calls `apply`, the model's own rotation (its ops table)."""

    positions: torch.Tensor  # [tokens]
    # float32 [max_positions, head_dim]: cos of the head_dim / 2 frequencies, then their sin (NeoX halves)
    cos_sin_cache: torch.Tensor
    head_dim: int
    apply: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # (q, k) -> rotated (q, k)


class AttentionBackend(abc.ABC):
    name: ClassVar[str]
    # True when the metadata for DECODE can live in static buffers a captured graph replays.
    supports_graph: ClassVar[bool] = False
    # True when the backend honours `AttentionContext.deterministic` (the only backends deterministic mode builds).
    batch_invariant: ClassVar[bool] = False

    def __init__(self, context: AttentionContext):
        self.context = context

    @abc.abstractmethod
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Plan the batch once, before the layers run."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayerSpec,
        batch: ForwardBatch,
        rotary: Rotary | None = None,
    ) -> torch.Tensor:
        """q [tokens, heads*head_dim], k/v [tokens, kv_heads*head_dim] -> [tokens, heads*head_dim].

        Rotates q and k by `rotary` where given, then stores k/v at `batch.out_cache_loc`, so the new tokens
        attend to themselves through the cache."""
        if rotary is not None:
            q, k = rotary.apply(q, k)
        if batch.mode is ForwardMode.DECODE:
            return self.forward_decode(q, k, v, layer, batch)
        return self.forward_extend(q, k, v, layer, batch)

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch) -> None:
        shape = (-1, layer.num_kv_heads, layer.head_dim)
        self.context.kv.kv_cache.set_kv(layer.layer_id, batch.out_cache_loc, k.view(shape), v.view(shape))

    @abc.abstractmethod
    def forward_extend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch
    ) -> torch.Tensor: ...

    @abc.abstractmethod
    def forward_decode(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch
    ) -> torch.Tensor: ...

    # --- graph hooks: a graph runner calls these (only on backends with supports_graph) ---
    def init_graph_state(self, max_batch_size: int) -> None:
        """Allocate the static metadata buffers captured graphs will read."""
        raise NotImplementedError(f"attention backend {self.name!r} cannot run inside a captured graph")

    def init_forward_metadata_capture(self, batch: ForwardBatch) -> None:
        """Point the metadata at the static buffers while a graph of this batch size is captured. `batch` is the
        graph runner's static batch: before every replay the runner refills its tensors with the real batch,
        padded (row 0, one key, padding slot 0), seq_lens inside the graph, so a backend may read them directly."""
        raise NotImplementedError(f"attention backend {self.name!r} cannot run inside a captured graph")

    def init_forward_metadata_replay(self, batch: ForwardBatch, padded_batch_size: int) -> None:
        """Refresh the static buffers in place from a real batch before a replay."""
        raise NotImplementedError(f"attention backend {self.name!r} cannot run inside a captured graph")

    def _checked_graph_state(self, state: Any, batch_size: int) -> Any:
        """`state` (the static buffers `init_graph_state` made, with a `max_batch_size`), checked to hold a batch."""
        if state is None:
            raise RuntimeError(f"{self.name}: call init_graph_state(max_batch_size) before capturing a graph")
        if batch_size > state.max_batch_size:
            raise ValueError(
                f"batch size {batch_size} exceeds the graph state's {state.max_batch_size}: "
                "call init_graph_state with the largest captured batch size"
            )
        return state


class HybridAttentionBackend(AttentionBackend):
    """Different backends for prefill (EXTEND) and decode, chosen with --prefill/--decode-attention-backend."""

    name = "hybrid"

    def __init__(self, prefill: AttentionBackend, decode: AttentionBackend):
        super().__init__(decode.context)
        self.prefill, self.decode = prefill, decode
        self.name = f"{prefill.name}+{decode.name}"

    @property
    def supports_graph(self) -> bool:  # type: ignore[override]
        return self.decode.supports_graph

    def _for(self, batch: ForwardBatch) -> AttentionBackend:
        return self.decode if batch.mode is ForwardMode.DECODE else self.prefill

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        self._for(batch).init_forward_metadata(batch)

    def forward(self, q, k, v, layer, batch, rotary=None):
        return self._for(batch).forward(q, k, v, layer, batch, rotary)

    def forward_extend(self, q, k, v, layer, batch):
        return self.prefill.forward_extend(q, k, v, layer, batch)

    def forward_decode(self, q, k, v, layer, batch):
        return self.decode.forward_decode(q, k, v, layer, batch)

    def init_graph_state(self, max_batch_size: int) -> None:
        self.decode.init_graph_state(max_batch_size)

    def init_forward_metadata_capture(self, batch: ForwardBatch) -> None:
        self.decode.init_forward_metadata_capture(batch)

    def init_forward_metadata_replay(self, batch: ForwardBatch, padded_batch_size: int) -> None:
        self.decode.init_forward_metadata_replay(batch, padded_batch_size)
