"""The runner's flags, named as in vLLM and SGLang, with their validation."""

from __future__ import annotations

import dataclasses
import os

from omnirun.errors import ConfigError

LOAD_FORMATS = ("auto", "safetensors", "dummy")
DTYPES = ("auto", "float32", "bfloat16", "float16", "fp32", "bf16", "fp16", "half")


@dataclasses.dataclass
class RunnerConfig:
    """Everything the ModelRunner needs to start. `None` means "let the runner or the platform decide"."""

    # An HF model directory; with load_format "dummy" also a preset name (see omnirun.loader.presets).
    model: str
    # None: $OMNIRUN_DEVICE, else auto.
    device: str | None = None
    dtype: str = "auto"
    load_format: str = "auto"
    kv_cache_dtype: str = "auto"
    page_size: int = 1
    # Share of the device's total memory for weights + KV cache (None: the platform's default).
    mem_fraction_static: float | None = None
    # Caps the KV pool at this many tokens (None: as many as the memory fraction allows).
    max_total_tokens: int | None = None
    max_running_requests: int | None = None
    context_length: int | None = None
    # One backend for both, or separate choices for prefill and decode (these win over attention_backend).
    attention_backend: str | None = None
    prefill_attention_backend: str | None = None
    decode_attention_backend: str | None = None
    disable_graph: bool = False
    # Decode batches up to this size replay captured graphs, larger ones run eagerly (None: the platform's limit).
    max_graph_batch_size: int | None = None
    seed: int = 0
    tp_size: int = 1
    # Mixtures of experts: whole experts on each of the --tp-size ranks instead of every expert's columns split.
    enable_expert_parallel: bool = False
    # Several nodes (SGLang's flags): how many, which one this is, and node 0's rendezvous address HOST:PORT.
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    # Seconds to wait for every rank to join, and for any collective later (None: 300 s to join, torch's default).
    dist_timeout: float | None = None
    # Which device of the platform this process uses (the local rank).
    device_index: int = 0
    # Show tqdm progress bars for loading and capture.
    progress: bool = True
    # Batch-invariant kernels: a request's tokens do not depend on what else is in its batch, on prefix-cache hits,
    # on how its prefill was chunked, or on graphs vs eager (SGLang's --enable-deterministic-inference).
    deterministic: bool = False

    def __post_init__(self) -> None:
        if self.load_format not in LOAD_FORMATS:
            raise ConfigError(f"--load-format {self.load_format!r} is unknown: choose one of {', '.join(LOAD_FORMATS)}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype {self.dtype!r} is unknown: choose one of {', '.join(DTYPES)}")
        if self.page_size < 1:
            raise ConfigError(f"--page-size must be >= 1, got {self.page_size}")
        if self.mem_fraction_static is not None and not 0.0 < self.mem_fraction_static <= 1.0:
            raise ConfigError(f"--mem-fraction-static must be in (0, 1], got {self.mem_fraction_static}")
        for flag, value in (
            ("--max-total-tokens", self.max_total_tokens),
            ("--max-running-requests", self.max_running_requests),
            ("--context-length", self.context_length),
            ("--max-graph-batch-size", self.max_graph_batch_size),
        ):
            if value is not None and value < 1:
                raise ConfigError(f"{flag} must be >= 1, got {value}")
        if self.tp_size < 1:
            raise ConfigError(f"--tp-size must be >= 1, got {self.tp_size}")
        if self.dist_timeout is not None and not self.dist_timeout > 0:
            raise ConfigError(f"--dist-timeout must be > 0 seconds, got {self.dist_timeout}")

    @property
    def distributed(self) -> bool:
        """Whether this process is one rank of several (tensor parallel, several nodes, or under torchrun)."""
        from omnirun.distributed.world import TORCHRUN_VARS

        launched = any(name in os.environ for name in TORCHRUN_VARS) and os.environ.get("WORLD_SIZE", "1") != "1"
        return self.tp_size > 1 or self.nnodes > 1 or launched
