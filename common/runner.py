"""ModelRunner: one model on one device, from a directory of weights to sampled tokens.

Start-up runs in this order, each step reading what the previous one settled:
    init distributed -> load the model -> KV dtype -> graph runner (the platform's, or none: eager)
    -> KV memory pool (sized from the memory left after loading, minus what the graphs will take)
    -> attention backends -> graph capture
Then the scheduler calls `forward(batch)` and `sample(logits, ...)` once per step. The runner never asks which
device it is on: it reads the platform's capabilities and asks the platform for the device-specific parts.
"""

from __future__ import annotations

import atexit
import functools
import gc
import logging
import socket
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from omnirun.attention.backend import AttentionBackend, AttentionContext, HybridAttentionBackend
from omnirun.attention.registry import attention_factories, choose_backend
from omnirun.batch import ForwardBatch, ForwardMode
from omnirun.config import RunnerConfig
from omnirun.distributed.process_group import init_process_group
from omnirun.errors import KVPoolTooSmallError, ModelLoadError, WeightUpdateError
from omnirun.layers.ops import resolve_ops
from omnirun.loader import (
    SafetensorsCheckpoint,
    context_length,
    init_dummy_weights,
    load_model_config,
    resolve_model_dtype,
)
from omnirun.memory import (
    KVMemory,
    KVPoolPlan,
    PageAllocator,
    PagedKVCache,
    ReqToTokenPool,
    plan_kv_pool,
    resolve_kv_cache_dtype,
)
from omnirun.models.architecture import decoder_shape
from omnirun.models.decoder import DecoderForCausalLM
from omnirun.platform import Platform
from omnirun.registry import select_platform
from omnirun.sampling import SampleOutput, Sampler, SamplingBatch, SamplingParams, TokenHistory
from omnirun.weights import apply_update, check_update, load_weights, read_weight

logger = logging.getLogger(__name__)

# Rows of the request-to-token table when --max-running-requests is not given.
DEFAULT_MAX_RUNNING_REQUESTS = 256

# Runners of this process that hold device memory (until close()): named when a new one finds too little left.
_open_runners: weakref.WeakSet[ModelRunner] = weakref.WeakSet()


class ModelRunner:
    def __init__(self, config: RunnerConfig, platform: Platform | None = None):
        self.config = config
        self.platform = platform if platform is not None else select_platform(config.device)
        self.platform.require_available()
        self.platform.set_device(config.device_index)
        self.device = self.platform.device(config.device_index)
        self.capabilities = self.platform.capabilities
        self.platform.manual_seed(config.seed)
        self._owns_process_group = False
        self._closed = False

        # Everything that can be checked from the config alone is checked before the weights load (minutes for a
        # large model): a typo must not cost a load.
        self.model_config = load_model_config(config.model, config.load_format)
        self.shape = decoder_shape(self.model_config)
        self.context_length = context_length(self.model_config, config.context_length)
        self.dtype = resolve_model_dtype(config.dtype, self.model_config, self.capabilities)
        self.kv_cache_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype, self.capabilities)
        self.max_running_requests = config.max_running_requests or DEFAULT_MAX_RUNNING_REQUESTS
        self._attention_choice = self._choose_attention()
        if config.max_total_tokens is not None and config.max_total_tokens < self.context_length:
            raise KVPoolTooSmallError(
                f"--max-total-tokens {config.max_total_tokens} cannot hold one request of the context length "
                f"{self.context_length}: raise it to >= {self.context_length}, or lower --context-length"
            )

        # Memory of runners that were dropped but not collected yet goes back before this one takes its share.
        gc.collect()
        _open_runners.add(self)
        try:
            self._init_distributed()
            self.model = self._load_model()
            # The graph runner exists before the KV pool so that its memory is taken out of the pool's budget; it
            # captures once the pool and the attention backend exist (the graphs read both).
            self.graph_runner = None if config.disable_graph else self.platform.make_graph_runner(self)
            self.kv = self._init_kv_memory()
            self.attention = self._init_attention()
            self.sampler = Sampler()
            if self.graph_runner is not None:
                self.graph_runner.capture(progress=config.progress)
        except BaseException:
            self.close()  # what a failed start-up allocated goes back at once, not when the runner is collected
            raise

    # --- start-up ---
    def _init_distributed(self) -> None:
        """Join a process group on the platform's backend (world size 1 here; a launcher may have joined one)."""
        if dist.is_available() and not dist.is_initialized():
            init_process_group(
                self.platform,
                rank=0,
                world_size=1,
                local_rank=self.config.device_index,
                init_method=f"tcp://127.0.0.1:{_free_port()}",
            )
            self._owns_process_group = True
            # Leave it at close(), or at exit: NCCL otherwise warns on every run that it was never destroyed.
            _leave_process_group_at_exit()

    def _load_model(self) -> DecoderForCausalLM:
        ops = resolve_ops(self.platform.fused_ops())
        with torch.device(self.device):
            model = DecoderForCausalLM(
                self.shape, self.model_config, max_positions=self.context_length, ops=ops, dtype=self.dtype
            )
        with torch.no_grad():
            if self.config.load_format == "dummy":
                init_dummy_weights(model, self.config.seed)
            else:
                checkpoint = SafetensorsCheckpoint(self.config.model)
                load_weights(model, checkpoint.iter_tensors(progress=self.config.progress))
            model.prepare_weights()
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        logger.info("loaded %s (%s, %.2f GiB of weights)", self.config.model, self.dtype, weight_bytes / 2**30)
        return model.eval()

    def _init_kv_memory(self) -> KVMemory:
        """Size the paged KV pool from what the device has left now that the weights are in."""
        self.platform.synchronize()
        self.platform.empty_cache()
        free, total = self.platform.memory_info(self.config.device_index)
        shape = self.shape
        try:
            plan = self._plan_kv_pool(free, total)
        except KVPoolTooSmallError as exc:
            others = [r for r in _open_runners if r is not self and r.platform is self.platform]
            if others:
                raise KVPoolTooSmallError(
                    f"{exc}; {len(others)} other runner(s) of this process still hold device memory: close() the "
                    "LLM (or ModelRunner) you no longer need, or use `with LLM(...) as llm:`"
                ) from None
            raise
        logger.info("KV cache: %s", plan.explanation)
        page_size = plan.page_size
        return KVMemory(
            PageAllocator(plan.num_pages, page_size),
            ReqToTokenPool(plan.max_running_requests, self.context_length, self.device),
            PagedKVCache(
                shape.num_layers,
                (plan.num_pages + 1) * page_size,  # + the padding page 0
                shape.num_kv_heads,
                shape.head_dim,
                self.kv_cache_dtype,
                self.device,
                page_size=page_size,
            ),
            page_size,
        )

    def _plan_kv_pool(self, free: int, total: int) -> KVPoolPlan:
        shape = self.shape
        return plan_kv_pool(
            free_bytes=free,
            total_bytes=total,
            mem_fraction_static=self.config.mem_fraction_static or self.platform.default_mem_fraction_static,
            bytes_per_token=PagedKVCache.bytes_per_token(
                shape.num_layers, shape.num_kv_heads, shape.head_dim, self.kv_cache_dtype
            ),
            page_size=self.config.page_size,
            context_length=self.context_length,
            max_running_requests=self.max_running_requests,
            max_total_tokens=self.config.max_total_tokens,
            reserved_bytes=self.graph_runner.reserved_bytes() if self.graph_runner is not None else 0,
        )

    def _choose_attention(self) -> tuple[str, str]:
        """The (prefill, decode) attention backends: the user's choice where the platform offers it."""
        offered, config = self.platform.attention_backends(), self.config

        def choose(mode: str) -> str:
            own = getattr(config, f"{mode}_attention_backend")
            flag = f"--{mode}-attention-backend" if own is not None else "--attention-backend"
            return choose_backend(
                own or config.attention_backend, offered, self.platform.default_attention_backend(mode), flag
            )

        return choose("prefill"), choose("decode")

    def _init_attention(self) -> AttentionBackend:
        factories = attention_factories(self.platform.attention_backend_factories())
        context = AttentionContext(
            kv=self.kv,
            device=self.device,
            model_dtype=self.dtype,
            num_heads=self.shape.num_heads,
            num_kv_heads=self.shape.num_kv_heads,
            head_dim=self.shape.head_dim,
            max_context_len=self.context_length,
        )
        prefill, decode = self._attention_choice
        if prefill == decode:
            backend = factories[prefill](context)
        else:
            backend = HybridAttentionBackend(factories[prefill](context), factories[decode](context))
        logger.info("attention: prefill %s, decode %s", prefill, decode)
        return backend

    # --- one step ---
    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [batch, vocab] for each request's last new token ([tokens, vocab] with return_full_logits)."""
        if self._closed:
            raise RuntimeError("this ModelRunner was closed: create a new one")
        if batch.mode is ForwardMode.IDLE:
            return torch.empty(0, self.shape.vocab_size, dtype=self.dtype, device=self.device)
        if self.graph_runner is not None and self.graph_runner.can_run(batch):
            return self.graph_runner.replay(batch)
        return self.forward_eager(batch)

    def forward_eager(self, batch: ForwardBatch) -> torch.Tensor:
        self.attention.init_forward_metadata(batch)
        return self.run_model(batch)

    def run_model(self, batch: ForwardBatch) -> torch.Tensor:
        """The model and the LM head on a batch whose attention metadata is set (what a graph captures)."""
        hidden = self.model(batch, self.attention)
        if batch.mode is ForwardMode.EXTEND and not batch.return_full_logits:
            last_tokens = batch.extend_seq_lens_cpu.cumsum(0) - 1
            hidden = hidden[last_tokens.to(self.device, non_blocking=True)]
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        token_index: Sequence[int],
        history: TokenHistory | None = None,
    ) -> SampleOutput:
        """Next token per request; token_index[i] counts request i's output tokens so far (seeded sampling,
        min_tokens). `history` (the requests' tokens, EOS ids) is what penalties and min_tokens read."""
        if all(p.greedy and p.logprobs is None and not p.adjusts_logits for p in params):
            # The common serving case needs no per-request tensors at all (each would be a host-to-device copy).
            return SampleOutput(token_ids=self.sampler.greedy(logits))
        batch = SamplingBatch.build(params, token_index, logits.device, vocab_size=logits.shape[-1], history=history)
        return self.sampler(logits, batch)

    # --- weights ---
    def update_weights_from_disk(self, model_path: str) -> None:
        """Replace every weight with those of another checkpoint of the same architecture and shapes.

        The checkpoint is checked (readable headers, known names, shapes, completeness) before any parameter is
        touched; a failure while copying restores every parameter bit for bit. The KV cache then holds keys and
        values of the old weights: the caller flushes it (finishes or recomputes running requests).
        """
        try:
            checkpoint = SafetensorsCheckpoint(model_path)
            specs = checkpoint.tensor_specs()
        except ModelLoadError as exc:
            raise WeightUpdateError(f"weight update refused, nothing changed: {exc}") from None
        check_update(self.model, {name: spec.shape for name, spec in specs.items()}, complete=True)
        with torch.no_grad():
            try:
                count = apply_update(self.model, checkpoint.iter_tensors(progress=self.config.progress))
            finally:  # changed or restored, the weights need their platform form again
                self.model.prepare_weights()
        self.platform.synchronize()
        logger.info("updated %d weight tensors from %s", count, model_path)

    def update_weights_from_tensor(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Overwrite some weights by HF name; all are checked first, and a failure rolls every one back."""
        named_tensors = list(named_tensors)
        check_update(self.model, {name: tuple(t.shape) for name, t in named_tensors}, complete=False)
        with torch.no_grad():
            try:
                apply_update(self.model, named_tensors)
            finally:
                self.model.prepare_weights()
        self.platform.synchronize()

    def get_weights_by_name(self, name: str, truncate_size: int | None = None) -> torch.Tensor:
        """A copy of one weight by its HF checkpoint name, optionally only its first `truncate_size` rows."""
        weight = read_weight(self.model, name)
        return weight if truncate_size is None else weight[:truncate_size]

    def weight_bytes_per_step(self) -> int:
        """Weight bytes one decode step must read: every parameter, except an untied embedding table (a lookup reads
        only the batch's rows; tied, the same table is read whole as the LM head)."""
        total = sum(p.numel() * p.element_size() for p in self.model.parameters())
        if not self.model.lm_head.tied:
            embedding = self.model.model.embed_tokens.weight
            total -= embedding.numel() * embedding.element_size()
        return total

    def close(self) -> None:
        """Give back everything this runner holds on the device: graphs and their memory pool, KV pool, attention
        state, weights, and the process group it joined. Idempotent; the runner cannot run afterwards."""
        if self._closed:
            return
        self._closed = True
        _open_runners.discard(self)
        try:
            self.platform.synchronize()
        finally:
            # Graphs first: their pool holds activations that point into the KV pool and the weights.
            for name in ("graph_runner", "attention", "kv", "model", "sampler"):
                if hasattr(self, name):
                    setattr(self, name, None)
            gc.collect()  # the runner, its graph runner and backends refer to each other
            self.platform.empty_cache()
            if self._owns_process_group:
                _leave_process_group()
                self._owns_process_group = False

    @property
    def closed(self) -> bool:
        return self._closed

    def describe(self) -> dict[str, Any]:
        """The settled start-up facts, for logs and `omnirun` reports."""
        return {
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "kv_cache_dtype": str(self.kv_cache_dtype).removeprefix("torch."),
            "kv_tokens": self.kv.total_tokens,
            "page_size": self.kv.page_size,
            "context_length": self.context_length,
            "attention": self.attention.name,
            "graph_runner": type(self.graph_runner).__name__ if self.graph_runner else "eager",
        }


def _leave_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


@functools.cache
def _leave_process_group_at_exit() -> None:
    atexit.register(_leave_process_group)  # once per process, however many runners come and go


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
