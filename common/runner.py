"""ModelRunner: one model on one device, from a directory of weights to sampled tokens.

Start-up runs in this order, each step reading what the previous one settled:
    tensor-parallel group (a launcher's, or none) -> load the model -> KV dtype
    -> graph runner (the platform's, or none: eager)
    -> KV memory pool (sized from the memory left after loading, minus what the graphs will take)
    -> attention backends -> graph capture
Then the scheduler calls `forward(batch)` and `sample(logits, ...)` once per step, or `forward_and_sample`, which
samples inside the decode graphs where they can. The runner never asks which
device it is on: it reads the platform's capabilities and asks the platform for the device-specific parts.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import logging
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from omnirun.assembly import assemble
from omnirun.attention.backend import AttentionBackend, AttentionContext, HybridAttentionBackend
from omnirun.batch import ForwardBatch, ForwardMode, HostBatch
from omnirun.config import RunnerConfig
from omnirun.distributed.link import WorkerLink
from omnirun.distributed.tensor_parallel import TensorParallel
from omnirun.distributed.weights_group import (
    DEFAULT_WEIGHTS_GROUP_TIMEOUT_S,
    join_weights_group,
    leave_weights_group,
    parse_incoming,
    receive_broadcast,
)
from omnirun.errors import DistributedInitError, KVPoolTooSmallError, ModelLoadError, WeightUpdateError
from omnirun.graphs import DecodeGraphRunner
from omnirun.layers.linear import Linear, QuantizedOf, full_precision
from omnirun.layers.moe import SparseMoE
from omnirun.layers.ops import deterministic_ops, resolve_ops
from omnirun.layers.prepared import held_bytes
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
from omnirun.memory.sizing import DEFAULT_RUNNING_REQUESTS
from omnirun.models.architecture import decoder_shape
from omnirun.models.decoder import KV_SCALES, DecoderForCausalLM
from omnirun.models.tp_layout import tp_layout
from omnirun.platform import Platform
from omnirun.quantization import KeptFormat, dequantized, quantized_format
from omnirun.registry import select_platform
from omnirun.sampling import SampleOutput, Sampler, SamplingBatch, SamplingParams, TokenHistory, graph_form
from omnirun.sampling.graph_form import GraphStep
from omnirun.weights import agree, apply_update, load_weights, read_weight, refuse_unless_agreed, update_problem

logger = logging.getLogger(__name__)


def _on_every_rank(method: Callable[..., Any]) -> Callable[..., Any]:
    """A collective method: on rank 0 of a tensor-parallel group it is first sent to the other ranks (with host
    copies of its tensors), which run it too. Each rank's part agrees with the others' inside the method."""

    @functools.wraps(method)
    def on_every_rank(self: ModelRunner, *args: Any, **kwargs: Any) -> Any:
        # Not sent again from inside another such method: the other ranks make that inner call themselves.
        if self.workers is None or self._sending_call:
            return method(self, *args, **kwargs)
        # Iterators are read once here, so that this rank and the others see the same items.
        args = tuple(list(a) if isinstance(a, Iterator) else a for a in args)
        self._sending_call = True
        try:
            with self.workers.guard():
                self.workers.call(method.__name__, args, kwargs)
                return method(self, *args, **kwargs)
        finally:
            self._sending_call = False

    return on_every_rank


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
        # Rank 0 of a tensor-parallel group: the other ranks, which run every step and collective call too.
        self.workers: WorkerLink | None = None
        self._sending_call = False  # inside a method run on every rank (see _on_every_rank)
        # Process groups shared with a trainer (RLHF weight updates), by name.
        self._weights_groups: dict[str, Any] = {}

        # Everything that can be checked from the config alone is checked before the weights load (minutes for a
        # large model): a typo must not cost a load.
        self.model_config = load_model_config(config.model, config.load_format)
        self.shape = decoder_shape(self.model_config)
        self.context_length = context_length(self.model_config, config.context_length)
        self.dtype = resolve_model_dtype(config.dtype, self.model_config, self.capabilities)
        # A quantized checkpoint's format (None: unquantized); one omnirun cannot load is refused here.
        # A dummy preset of a quantized shape has one too (random weights of its layout).
        self.quantization = quantized_format(self.model_config)
        self.kv_cache_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype, self.capabilities)
        # Without the flag, the most the default allows until the pool is planned and sets it (`plan_kv_pool`).
        self.max_running_requests = config.max_running_requests or DEFAULT_RUNNING_REQUESTS[1]
        self.assembly = assemble(
            config,
            self.platform,
            self.dtype,
            self.max_running_requests,
            self.shape.head_dim,
            experts=self.shape.moe is not None,
        )
        self.attention_choice = (self.assembly.prefill_attention, self.assembly.decode_attention)
        # heads, MLP and experts split over --tp-size, or a one-line error now
        tp_layout(self.shape, config.tp_size, 0, config.enable_expert_parallel)
        if config.max_total_tokens is not None and config.max_total_tokens < self.context_length:
            raise KVPoolTooSmallError(
                f"--max-total-tokens {config.max_total_tokens} cannot hold one request of the context length "
                f"{self.context_length}: raise it to >= {self.context_length}, or lower --context-length"
            )

        # Memory of runners that were dropped but not collected yet goes back before this one takes its share.
        gc.collect()
        _open_runners.add(self)
        try:
            self.tp = self._init_distributed()
            self.layout = tp_layout(self.shape, self.tp.size, self.tp.rank, self.config.enable_expert_parallel)
            self.ops = resolve_ops(self.platform.fused_ops())  # the layers' kernels and the sampler's picks
            if config.deterministic:
                self.ops = deterministic_ops(self.ops)
            self.model = self._load_model()
            # The graph runner exists before the KV pool so that its memory is taken out of the pool's budget; it
            # captures once the pool and the attention backend exist (the graphs read both).
            self.graph_runner = self._make_graph_runner()
            self.kv = self._init_kv_memory()
            self.attention = self._init_attention()
            self.sampler = Sampler(
                self.ops.argmax, self.ops.sample, self.ops.apply_penalties, self.ops.apply_token_bitmask
            )
            if self.graph_runner is not None:
                self.graph_runner.capture(progress=config.progress)
        except BaseException:
            self.close()  # what a failed start-up allocated goes back at once, not when the runner is collected
            raise

    def own_process_group(self, workers: WorkerLink | None) -> None:
        """The launcher hands over what its start-up joined: from now on close() shuts `workers` (rank 0's link
        to the other ranks; None elsewhere) down and leaves the process group."""
        self._owns_process_group = True
        self.workers = workers

    # --- start-up ---
    def _init_distributed(self) -> TensorParallel:
        """The tensor-parallel group: the world a launcher joined (every rank of it holds a part of the model), or
        none for a single device (a world of one needs no process group: its collectives are no-ops)."""
        tp_size = self.config.tp_size
        if not (dist.is_available() and dist.is_initialized()):
            if tp_size > 1:
                raise DistributedInitError(
                    f"a ModelRunner with --tp-size {tp_size} runs on one rank of a process group that is not joined: "
                    "use LLM(..., tp_size=N) or `omnirun ... --tp-size N` (they start the ranks), or "
                    "omnirun.launch.start_runner"
                )
            return TensorParallel.single()
        world = dist.get_world_size()
        if world != tp_size:
            raise DistributedInitError(
                f"this process joined a world of {world} rank(s) but --tp-size is {tp_size}: ask for --tp-size "
                f"{world}, or launch {tp_size} ranks (close the tensor-parallel LLM of this process first)"
            )
        return TensorParallel(dist.get_rank(), world, self.platform.make_communicator(None))

    def _load_model(self) -> DecoderForCausalLM:
        with torch.device(self.device):
            model = DecoderForCausalLM(
                self.shape,
                self.model_config,
                max_positions=self.context_length,
                ops=self.ops,
                dtype=self.dtype,
                tp=self.tp,
                layout=self.layout,
                quantized_of=self._quantized_layers(),
            )
        with torch.no_grad():
            if self.config.load_format == "dummy":
                init_dummy_weights(model, self.config.seed)  # drawn whole per checkpoint tensor, then this rank's part
            else:
                # Lazy: each rank reads only its own slice of every tensor from the files.
                checkpoint = SafetensorsCheckpoint(self.config.model)
                progress = self.config.progress and self.tp.is_first
                tensors = checkpoint.iter_tensors(progress=progress, lazy=True)
                if self.quantization is not None:  # kept where the layer holds it, else dequantized now, once
                    keeps, elsewhere = _holds_scales(model), _held_elsewhere(model)
                    tensors = dequantized(tensors, self.quantization, self.dtype, keeps=keeps, elsewhere=elsewhere)
                load_weights(model, tensors)
            model.prepare_weights()
        on_device, on_host = held_bytes(model)
        logger.info(
            "loaded %s (%s, %.2f GiB of weights on tp rank %d of %d%s)",
            self.config.model,
            self.dtype,
            on_device / 2**30,
            self.tp.rank,
            self.tp.size,
            f"; {on_host / 2**30:.2f} GiB of loaded quantized words in host memory" if on_host else "",
        )
        return model.eval()

    def _quantized_layers(self) -> QuantizedOf:
        """Which linear layers keep the checkpoint's quantized weights: all it quantizes (as the format keeps them),
        where the platform runs the format's op (`fp8_linear`, `int4_linear`) and the run is not deterministic
        (whose linears read plain weights); else none."""
        fmt = self.quantization
        if self.config.deterministic or not isinstance(fmt, KeptFormat) or not fmt.kept_by(self.ops):
            return full_precision
        return fmt.quantized_of()

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
                error = KVPoolTooSmallError(
                    f"{exc}; {len(others)} other runner(s) of this process still hold device memory: close() the "
                    "LLM (or ModelRunner) you no longer need, or use `with LLM(...) as llm:`"
                )
            else:
                error = exc
            self._agree_on_kv_pool(None, free, total)  # the other ranks learn that this one cannot build a pool
            raise error from None
        plan = self._agree_on_kv_pool(plan, free, total)
        logger.info("KV cache: %s", plan.explanation)
        # From the agreed plan: every rank of a tensor-parallel group has the same pool, so the same limit.
        self.max_running_requests = plan.max_running_requests
        page_size = plan.page_size
        cache = PagedKVCache(
            shape.num_layers,
            (plan.num_pages + 1) * page_size,  # + the padding page 0
            self.layout.num_kv_heads,
            shape.head_dim,
            self.kv_cache_dtype,
            self.device,
            page_size=page_size,
        )
        if cache.quantized:
            try:
                cache.set_scales(*self.model.kv_scales())
            except ValueError as exc:
                raise ModelLoadError(
                    f"the checkpoint's k_scale/v_scale: {exc}; re-export its KV cache scales"
                ) from None
        return KVMemory(
            PageAllocator(plan.num_pages, page_size),
            ReqToTokenPool(plan.max_running_requests, self.context_length, self.device),
            cache,
            page_size,
        )

    def _plan_kv_pool(self, free: int, total: int, max_total_tokens: int | None = None) -> KVPoolPlan:
        shape = self.shape
        return plan_kv_pool(
            free_bytes=free,
            total_bytes=total,
            mem_fraction_static=self.config.mem_fraction_static or self.platform.default_mem_fraction_static,
            bytes_per_token=PagedKVCache.bytes_per_token(
                shape.num_layers, self.layout.num_kv_heads, shape.head_dim, self.kv_cache_dtype
            ),
            page_size=self.config.page_size,
            context_length=self.context_length,
            max_running_requests=self.config.max_running_requests,
            max_total_tokens=max_total_tokens or self.config.max_total_tokens,
            reserved_bytes=self.graph_runner.reserved_bytes() if self.graph_runner is not None else 0,
            default_kv_bytes=self._default_kv_bytes(),
        )

    def _default_kv_bytes(self) -> int | None:
        """The platform's default KV pool size (the CPU's), unless the user sized the pool with a flag."""
        if self.config.mem_fraction_static is not None or self.config.max_total_tokens is not None:
            return None
        return self.platform.default_kv_cache_bytes()

    def _agree_on_kv_pool(self, plan: KVPoolPlan | None, free: int, total: int) -> KVPoolPlan:
        """Every rank builds the same pool (the schedule on rank 0 addresses all of them): the smallest rank's.

        `plan` None: this rank cannot build one; every other rank then raises too, naming it."""
        if self.tp.size == 1:
            return plan
        mine = torch.tensor([plan.num_pages if plan is not None else -1], dtype=torch.int64, device=self.device)
        pages = self.tp.comm.all_gather(mine).tolist()
        logger.info("KV pool pages per rank: %s", ", ".join(f"rank {r}: {n}" for r, n in enumerate(pages)))
        failed = [rank for rank, n in enumerate(pages) if n < 0]
        if plan is None:
            return None
        if failed:
            raise KVPoolTooSmallError(
                f"rank(s) {', '.join(map(str, failed))} have no room for a KV pool (their own error says why): free "
                "memory on their devices or lower --mem-fraction-static there"
            )
        smallest = min(pages)
        if smallest == plan.num_pages:
            return plan
        capped = self._plan_kv_pool(free, total, max_total_tokens=smallest * plan.page_size)
        return dataclasses.replace(capped, explanation=f"{capped.explanation} (the smallest rank's: {smallest} pages)")

    def _make_graph_runner(self) -> DecodeGraphRunner | None:
        """The decode graph runner the assembly plans. A platform of contract version 1 that overrides
        `make_graph_runner(runner)` still decides (deprecated)."""
        if self.config.disable_graph:
            return None
        if type(self.platform).make_graph_runner is not Platform.make_graph_runner:
            return self.platform.make_graph_runner(self)
        return self.planned_graph_runner()

    def planned_graph_runner(self) -> DecodeGraphRunner | None:
        """The decode graph runner over the platform's graph API up to the batch the assembly plans (None: every
        step runs eagerly, `assembly.graphs_reason` says why)."""
        if self.assembly.graphs is None:
            return None
        return DecodeGraphRunner(self, self.platform.graph_api(), max_batch_size=self.assembly.graph_max_batch_size)

    def _init_attention(self) -> AttentionBackend:
        offers = {name: self.platform.attention_offer(name) for name in self.attention_choice}
        context = AttentionContext(
            kv=self.kv,
            device=self.device,
            model_dtype=self.dtype,
            num_heads=self.layout.num_heads,
            num_kv_heads=self.layout.num_kv_heads,
            head_dim=self.shape.head_dim,
            max_context_len=self.context_length,
            deterministic=self.config.deterministic,
        )
        prefill, decode = self.attention_choice
        if prefill == decode:
            backend = offers[prefill].build(context)
        else:
            backend = HybridAttentionBackend(offers[prefill].build(context), offers[decode].build(context))
        logger.info("parts: %s", self.assembly.summary())
        return backend

    # --- one step ---
    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [batch, vocab] for each request's last new token ([tokens, vocab] with return_full_logits; the rows
        `batch.logit_rows` names, when set)."""
        if self._closed:
            raise RuntimeError("this ModelRunner was closed: create a new one")
        if batch.mode is ForwardMode.IDLE:
            return torch.empty(0, self.shape.vocab_size, dtype=self.dtype, device=self.device)
        if self.workers is None:
            return self._forward_on_every_rank(batch)
        if batch.host is None:
            raise ValueError("a tensor-parallel step needs a batch from build_batch (its host copy goes to the ranks)")
        with self.workers.guard():
            self.workers.send("step", dataclasses.replace(batch.host, input_ids_pending=batch.input_ids_pending))
            return self._forward_on_every_rank(batch)

    @torch.inference_mode()
    def run_step(self, host: HostBatch) -> None:
        """Another rank's part of the step rank 0 sent: the same batch, its request-to-token entries, the forward
        pass (the logits are rank 0's to sample)."""
        batch = host.to_device(self.device)
        # Rank 0 wrote these entries when it allocated the slots (KVMemory.alloc_tokens); the pages are the same here.
        rows = batch.req_pool_indices.repeat_interleave(
            batch.extend_seq_lens_cpu.to(self.device), output_size=batch.num_tokens
        )
        self.kv.req_to_token.table[rows, batch.positions] = batch.out_cache_loc.to(torch.int32)
        if host.prefix_entries is not None:  # pages the prefix cache shared into rows (KVMemory.share_prefix)
            rows, positions, slots = host.prefix_entries.to(self.device).unbind()
            self.kv.req_to_token.table[rows, positions] = slots.to(torch.int32)
        self._forward_on_every_rank(batch)

    def _forward_on_every_rank(self, batch: ForwardBatch) -> torch.Tensor:
        if batch.input_ids_pending and self.tp.size > 1:
            self.tp.comm.broadcast(batch.input_ids)  # rank 0 filled them on its device; the others receive them
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
            rows = batch.logit_rows
            if rows is None:  # each request's last token
                rows = (batch.extend_seq_lens_cpu.cumsum(0) - 1).to(self.device, non_blocking=True)
            hidden = hidden[rows]
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def forward_and_sample(
        self,
        batch: ForwardBatch,
        params: Sequence[SamplingParams],
        token_index: Sequence[int],
        history: TokenHistory | None = None,
        token_bitmask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, SampleOutput]:
        """`forward(batch)`, then `sample` of its logits (one row per request, `params` in row order): the logits
        and the tokens. A decode step the graphs replay samples inside them where the graph's sampler serves every
        row (omnirun.sampling.graph_form says which), with the same tokens and logprobs as the eager sampler;
        its outputs are then static tensors, valid until the next step, as the replayed logits are."""
        step = self._graph_sampling(batch, params, token_index, token_bitmask)
        logits = self.forward(batch)
        if step is None:
            return logits, self.sample(logits, params, token_index, history, token_bitmask)
        return logits, self.graph_runner.sample_replayed(batch.batch_size, step)

    def _graph_sampling(
        self,
        batch: ForwardBatch,
        params: Sequence[SamplingParams],
        token_index: Sequence[int],
        token_bitmask: torch.Tensor | None,
    ) -> GraphStep | None:
        """How the graphs sample this step (None: the forward's logits go to the eager sampler)."""
        graphs = self.graph_runner
        if (
            not isinstance(graphs, DecodeGraphRunner)
            or not graphs.serves_sampling()
            or token_bitmask is not None
            or len(params) != batch.batch_size
            or not graphs.can_run(batch)
            or not graph_form.serves(params, token_index)
        ):
            return None
        padded = graphs.padded_size(batch.batch_size)
        return graph_form.plan_step(params, token_index, graphs.vocab, padded, graphs.widths)

    @torch.inference_mode()
    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        token_index: Sequence[int],
        history: TokenHistory | None = None,
        token_bitmask: torch.Tensor | None = None,
    ) -> SampleOutput:
        """Next token per request; token_index[i] counts request i's output tokens so far (seeded sampling,
        min_tokens). `history` (the requests' tokens, EOS ids) is what penalties and min_tokens read;
        `token_bitmask` (on the logits' device) the tokens each request's grammar allows."""
        if token_bitmask is None and all(p.greedy and p.logprobs is None and not p.adjusts_logits for p in params):
            # The common serving case needs no per-request tensors at all (each would be a host-to-device copy).
            return SampleOutput(token_ids=self.sampler.greedy(logits))
        vocab = logits.shape[-1]
        batch = SamplingBatch.build(
            params, token_index, logits.device, vocab_size=vocab, history=history, token_bitmask=token_bitmask
        )
        return self.sampler(logits, batch)

    # --- weights ---
    @_on_every_rank
    def update_weights_from_disk(self, model_path: str) -> None:
        """Replace every weight with those of another checkpoint of the same architecture and shapes.

        The checkpoint is checked (readable headers, known names, shapes, completeness) before any parameter is
        touched; a failure while copying restores every parameter bit for bit. The KV cache then holds keys and
        values of the old weights: the caller flushes it (finishes or recomputes running requests).

        Under tensor parallelism every rank calls this with the same path and reads only its slices; a refusal or a
        failure on any rank is raised on every rank, and a failure rolls every rank back.
        """
        try:
            # The checkpoint's own config, where it has one, says whether it is quantized.
            has_config = (Path(model_path) / "config.json").is_file()
            quantized = quantized_format(load_model_config(model_path, "auto")) if has_config else None
            if quantized is not None:
                raise ModelLoadError(
                    f"update_weights_from_disk takes unquantized checkpoints, and {model_path} is "
                    f"{quantized.describe()}: dequantize it first (or start a new LLM on it)"
                )
            checkpoint = SafetensorsCheckpoint(model_path)
            specs = checkpoint.tensor_specs()
            problem = update_problem(
                self.model,
                {name: spec.shape for name, spec in specs.items()},
                complete=True,
                dtypes={name: spec.dtype for name, spec in specs.items()},
            ) or self._kv_scales_fixed(specs)
        except ModelLoadError as exc:
            problem = str(exc)
        refuse_unless_agreed(self.tp.comm, problem)
        with torch.no_grad():
            try:
                progress = self.config.progress and self.tp.is_first
                count = apply_update(self.model, checkpoint.iter_tensors(progress=progress, lazy=True), self.tp.comm)
            finally:  # changed or restored, the weights need their platform form again
                self._prepare_updated_weights()
        self.platform.synchronize()
        logger.info("updated %d weight tensors from %s", count, model_path)

    @_on_every_rank
    def update_weights_from_tensor(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Overwrite some weights by HF name; all are checked first, and a failure rolls every one back.

        Under tensor parallelism every rank calls this with the same FULL tensors (HF shapes) and keeps its part."""
        named_tensors = list(named_tensors)
        problem = update_problem(
            self.model,
            {name: tuple(t.shape) for name, t in named_tensors},
            complete=False,
            dtypes={name: t.dtype for name, t in named_tensors},
        ) or self._kv_scales_fixed(dict(named_tensors))
        refuse_unless_agreed(self.tp.comm, problem)
        with torch.no_grad():
            try:
                apply_update(self.model, named_tensors, self.tp.comm)
            finally:
                self._prepare_updated_weights()
        self.platform.synchronize()

    def _prepare_updated_weights(self) -> None:
        """The platform's forms of updated weights, and the decode graphs captured again where a form could not be
        refreshed in place (they would read the old one). Every rank recaptures if any must: a capture runs the
        collectives of every rank."""
        in_place = self.model.prepare_weights()
        if self.graph_runner is None or not agree(self.tp.comm, None if in_place else "a form made anew"):
            return
        logger.info("a weight update changed the structure of a platform's weight form: capturing the graphs again")
        if isinstance(self.graph_runner, DecodeGraphRunner):
            self.graph_runner.release()
        self.graph_runner.capture(progress=False)

    def _kv_scales_fixed(self, names: Iterable[str]) -> str | None:
        """Why an update must not carry KV-cache scales: an fp8 cache stores with them from start-up on (tokens
        already cached, and captured graphs, hold the old ones)."""
        scales = sorted(name for name in names if name.endswith(tuple(f".{s}" for s in KV_SCALES)))
        if not scales or not self.kv.kv_cache.quantized:
            return None
        return (
            f"{scales[0]} sets the fp8 KV cache's scale, fixed at start-up: leave the k_scale/v_scale tensors out of "
            "the update, or start a new LLM on the new checkpoint"
        )

    @_on_every_rank
    def get_weights_by_name(self, name: str, truncate_size: int | None = None) -> torch.Tensor:
        """A copy of one weight by its HF checkpoint name, optionally only its first `truncate_size` rows; whole
        under tensor parallelism (gathered from every rank: every rank must call it with the same name)."""
        weight = read_weight(self.model, name, self.tp.comm, self.device)
        return weight if truncate_size is None else weight[:truncate_size]

    def weight_bytes_per_step(self, batch_size: int = 1) -> int:
        """Weight bytes one decode step of `batch_size` requests must read on this rank (its share under tensor
        parallelism): every parameter, except an untied embedding table (a lookup reads only the batch's rows;
        tied, the same table is read whole as the LM head), and of a mixture of experts only the experts the batch
        is expected to reach: with top_k of E experts per token, routed evenly, each expert is missed by all
        batch_size tokens with probability (1 - top_k / E) ** batch_size."""
        total = sum(p.numel() * p.element_size() for p in self.model.parameters())
        if not self.model.lm_head.tied:
            embedding = self.model.model.embed_tokens.weight
            total -= embedding.numel() * embedding.element_size()
        for module in self.model.modules():
            if isinstance(module, SparseMoE):
                experts = sum(p.numel() * p.element_size() for p in module.weights())
                missed = (1 - module.top_k / module.num_experts) ** batch_size
                total -= round(experts * missed)
        return total

    def close(self) -> None:
        """Give back everything this runner holds on the device: graphs and their memory pool, KV pool, attention
        state, weights, and the process group it joined. Idempotent; the runner cannot run afterwards."""
        if self._closed:
            return
        self._closed = True
        _open_runners.discard(self)
        if self.workers is not None:
            self.workers.shutdown()  # each rank closes its own runner
        for group in self._weights_groups.values():
            leave_weights_group(group)
        self._weights_groups.clear()
        try:
            self.platform.synchronize()
        finally:
            # Graphs first: their pool holds activations that point into the KV pool and the weights.
            for name in ("graph_runner", "attention", "kv", "model", "sampler", "ops"):
                if hasattr(self, name):
                    setattr(self, name, None)
            gc.collect()  # the runner, its graph runner and backends refer to each other
            self.platform.empty_cache()
            if self._owns_process_group:
                if dist.is_initialized():
                    dist.destroy_process_group()
                self.platform.unbind_rank()  # bound by the launcher that joined the group
            self._owns_process_group = False

    @property
    def closed(self) -> bool:
        return self._closed

    def describe(self) -> dict[str, Any]:
        """The settled start-up facts, for logs and `omnirun` reports."""
        return {
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "kv_cache_dtype": self._kv_cache_format(),
            "kv_tokens": self.kv.total_tokens,
            "page_size": self.kv.page_size,
            "context_length": self.context_length,
            "max_running_requests": self.max_running_requests,
            "attention": self.attention.name,
            "graph_runner": type(self.graph_runner).__name__ if self.graph_runner else "eager",
            "deterministic": self.config.deterministic,
            "weights": self.weights_format(),
            "experts": self.experts_format(),
        }

    def _kv_cache_format(self) -> str:
        """The KV cache's storage dtype, and for fp8 whether it stores with the checkpoint's per-layer scales."""
        cache = self.kv.kv_cache
        dtype = str(cache.dtype).removeprefix("torch.")
        if not cache.quantized:
            return dtype
        if any(s != 1.0 for s in (*cache.k_scales, *cache.v_scales)):
            return f"{dtype} (k/v scales from the checkpoint)"
        return f"{dtype} (scale 1: the checkpoint has no k/v scales)"

    def experts_format(self) -> str | None:
        """A mixture of experts' routing and how this rank holds the experts (None: a dense model)."""
        moe = self.shape.moe
        if moe is None:
            return None
        held = (
            f"experts {self.layout.expert_start}-{self.layout.expert_start + self.layout.experts_per_rank - 1} whole"
            if self.layout.expert_parallel
            else f"each expert's columns split {self.tp.size} ways"
            if self.tp.size > 1
            else "every expert whole"
        )
        moes = [m for m in self.model.modules() if isinstance(m, SparseMoE)]
        fp8, int4 = any(m.fp8 is not None for m in moes), any(m.int4 is not None for m in moes)
        name = "fp8_fused_moe" if fp8 else "int4_fused_moe" if int4 else "fused_moe"
        op = getattr(self.ops, name)
        tiles = getattr(op, "keywords", {}).get("tiles")  # a kernel bound to a device's launch table
        table = f" (launch table: {Path(tiles.source).name})" if tiles is not None else ""
        kept = " in fp8" if fp8 else " packed in int4" if int4 else ""
        return f"top {moe.top_k} of {moe.num_experts}, {held}{kept}, {name} {_op_origin(op)}{table}"

    def weights_format(self) -> str:
        """How the checkpoint's weights are held: the model dtype, a quantized format dequantized at load, or fp8 or
        int4 kept for the platform's `fp8_linear` or `int4_linear`."""
        dtype = str(self.dtype).removeprefix("torch.")
        if self.quantization is None:
            return dtype
        linears = [m for m in self.model.modules() if isinstance(m, Linear)]
        for kind, op in (("fp8", self.ops.fp8_linear), ("int4", self.ops.int4_linear)):
            kept = sum(1 for m in linears if getattr(m, kind) is not None)
            if kept:
                held = f"{kept} linear layers kept in {kind} ({kind}_linear {_op_origin(op)}), the rest {dtype}"
                return f"{self.quantization.describe()}, {held}"
        return f"{self.quantization.describe()}, dequantized to {dtype} at load"

    # --- weights from a trainer (RLHF): a process group shared with it, the trainer's rank 0 broadcasting ---
    @_on_every_rank
    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str | None = None,
        timeout_s: float = DEFAULT_WEIGHTS_GROUP_TIMEOUT_S,
    ) -> None:
        """Join the trainer's group `group_name` (world_size members, the trainer's rank 0 among them) as rank
        rank_offset + this tp rank; every rank calls it. `backend` defaults to the platform's collective backend."""
        groups = self._weights_groups
        if group_name in groups:
            raise WeightUpdateError(f"weights update group {group_name!r} is already joined: destroy it first")
        groups[group_name] = join_weights_group(
            host=master_address,
            port=int(master_port),
            rank=rank_offset + self.tp.rank,
            world_size=world_size,
            group_name=group_name,
            backend=backend or self.platform.distributed_backend,
            timeout_s=timeout_s,
        )
        logger.info("joined weights update group %r at %s:%s", group_name, master_address, master_port)

    @_on_every_rank
    def update_weights_from_distributed(
        self, names: Sequence[str], dtypes: Sequence, shapes: Sequence, group_name: str
    ) -> None:
        """Receive each named FULL tensor by broadcast from the trainer's rank 0, then update as
        update_weights_from_tensor does (checked before any parameter changes; a failure rolls every rank back).

        Every rank calls it with the same metadata. Every tensor is received even when the update is then refused,
        so the group stays in step with the trainer; metadata that cannot be received (bad dtype or shape) is
        refused before anything is received."""
        group = self._weights_group(group_name)
        incoming = parse_incoming(names, dtypes, shapes)
        received = receive_broadcast(group, incoming, self.device)
        self.update_weights_from_tensor(received)

    @_on_every_rank
    def destroy_weights_update_group(self, group_name: str) -> None:
        """Leave the trainer's group `group_name` (every rank calls it)."""
        leave_weights_group(self._weights_group(group_name))
        del self._weights_groups[group_name]

    def _weights_group(self, group_name: str) -> Any:
        groups = self._weights_groups
        if group_name not in groups:
            known = ", ".join(repr(n) for n in groups) or "none"
            raise WeightUpdateError(
                f"no weights update group named {group_name!r} (joined: {known}): call init_weights_update_group first"
            )
        return groups[group_name]


def _holds_scales(model: torch.nn.Module) -> Callable[[str], bool]:
    """Whether the checkpoint layer of a name keeps its quantized weight: the model has a `weight_scale` for it."""

    def holds(layer: str) -> bool:
        try:
            return model.checkpoint_target(f"{layer}.weight_scale") is not None
        except KeyError:
            return False

    return holds


def _held_elsewhere(model: torch.nn.Module) -> Callable[[str], bool]:
    """Whether the checkpoint layer of a name lives on another rank (an expert under expert parallelism): this rank
    has no target for its weight."""

    def elsewhere(layer: str) -> bool:
        try:
            return model.checkpoint_target(f"{layer}.weight") is None
        except (KeyError, ValueError):  # unknown here, or kept quantized: the load says what is wrong, if anything
            return False

    return elsewhere


def _op_origin(op: Any) -> str:
    """Where an op of the table comes from: the torch reference, or the module of a platform's kernel (through
    functools.partial, which kernels are bound with)."""
    while isinstance(op, functools.partial):
        op = op.func
    module = getattr(op, "__module__", None) or "a platform kernel"
    return "reference" if module == "omnirun.layers.native_ops" else module
