"""Decode steps captured as device graphs, one per batch size, replayed with the batch padded to the next size.

Device-neutral: a platform's `graph_api()` hands over its graph API (CUDA and HIP graphs through torch.cuda, ...)
and `make_graph_runner` builds this runner over it. A decode step's inputs live in static buffers that every
captured graph reads, rows of one tensor; a replay copies the batch into them (one copy where the batch's inputs
are still the views of its packed device copy), pads the rest with a harmless dummy request (row 0, one token,
writing the padding slot 0), lets the attention backend refresh its static metadata, and replays.

On the rank that samples, each batch size's graph also takes the argmax of its logits (a greedy step needs nothing
else), and small graphs beside it hold the rest of the sampler in its general form (omnirun.sampling.graph_form):
one per short-list width the `sample` op asks for, reading the sampling parameters from one more static tensor
(refreshed with one copy per sampled step), and one for logprobs. They share the graphs' memory pool; their
outputs are static tensors too, valid until the next step replays.
"""

from __future__ import annotations

import bisect
import functools
import gc
import logging
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch

from omnirun.batch import ForwardBatch, ForwardMode
from omnirun.facts import GraphAPI
from omnirun.sampling import SampleOutput
from omnirun.sampling.graph_form import GRAPH_TOP_LOGPROBS, GraphStep, graph_batch, graph_widths, padding_rows
from omnirun.sampling.sampler import token_logprobs
from omnirun.sampling.shortlist import MAX_SHORTLIST

if TYPE_CHECKING:
    from omnirun.runner import ModelRunner

logger = logging.getLogger(__name__)


def capture_batch_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 256, every 16 beyond: padding wastes at most a few rows per step."""
    sizes = [1, 2, 4, 8] + list(range(16, 257, 8)) + list(range(272, max_batch_size + 1, 16))
    sizes = [s for s in sizes if s < max_batch_size]
    return sizes + [max_batch_size]


class DecodeGraphRunner:
    def __init__(self, runner: ModelRunner, api: GraphAPI, max_batch_size: int):
        # Built before the KV pool exists (so that `reserved_bytes` can shrink it); `capture` runs once it does.
        self.runner = runner
        self.api = api
        self.batch_sizes = capture_batch_sizes(max_batch_size)
        self.max_batch_size = max_batch_size
        self.graphs: dict[int, tuple[Any, torch.Tensor, ForwardBatch]] = {}
        # The sampler's graphs per batch size (the rank that samples only): one per short-list width, and logprobs'
        # with its outputs (chosen [bs], top ids and logprobs [bs, GRAPH_TOP_LOGPROBS]).
        self.samplers: dict[int, dict[int, Any]] = {}
        self.logprob_graphs: dict[int, tuple[Any, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
        self.samples = False  # argmax in the forward's graph, and the sampler's graphs (set at capture)
        self.widths: tuple[int, ...] = ()  # the short-list widths captured (): sampled steps sample eagerly)
        self.sample_op: Any = None  # the `sample` op the sampler's graphs hold
        # False: every step's sampling runs eagerly after the replay (bench/sampling_cost.py compares the two).
        self.sample_in_graph = True
        self.sampler_capture_s = 0.0  # the time capture spent on the sampler's graphs

    def reserved_bytes(self) -> int:
        """Device memory the captured graphs' pool will hold (activations of the largest batch, logits included),
        taken out of the KV budget before the pool is sized. An estimate with a 2x margin, plus workspaces."""
        shape, bs = self.runner.shape, self.max_batch_size
        item = self.runner.dtype.itemsize
        # A mixture of experts holds each token's top_k slots: gate|up and activation per slot, a float32 output
        # per slot, and the routing's small tensors.
        moe = shape.moe
        mlp = 4 * shape.intermediate_size * item
        if moe is not None:
            mlp = max(mlp, moe.top_k * (4 * moe.intermediate_size * item + 4 * shape.hidden_size + 64))
        per_token = (
            shape.vocab_size * (item + 4)  # logits, and a float32 copy the sampler may make
            + mlp  # the MLP's gate|up and its activation (the experts' slots)
            + 12 * shape.hidden_size * item  # hidden, residual, norms, attention in/out
            + 3 * (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim * item  # qkv, rotated q/k
            + shape.num_heads * 32 * (shape.head_dim + 1) * 4  # split-K partials of a decode kernel
            + MAX_SHORTLIST * (item + 8)  # a sampler graph's short list (values and ids)
        )
        return 2 * bs * per_token + (256 << 20)

    # --- capture ---
    def release(self) -> None:
        """Drop every captured graph and its pool's memory (before capturing again)."""
        self.graphs.clear()
        self.samplers.clear()
        self.logprob_graphs.clear()
        gc.collect()

    def capture(self, progress: bool = True) -> None:
        backend = self.runner.attention
        if not backend.supports_graph:
            logger.warning("attention backend %s cannot run in a graph: decode runs eagerly", backend.name)
            self.batch_sizes = []
            return
        device, max_bs = self.runner.device, self.max_batch_size
        # The static int inputs as the rows of one tensor laid out like a batch's `decode_inputs()`, so that a
        # replay fills them with one copy; the attention kernels' int32 seq_lens is cast from row 4 in the graph.
        self.inputs = torch.zeros(5, max_bs, dtype=torch.int64, device=device)
        # Padding rows: token 0 at position 0 of request row 0, one token long, writing the padding slot 0.
        self.padding = torch.tensor([0, 0, 0, 0, 1], dtype=torch.int64, device=device)[:, None].expand(5, max_bs)
        self.inputs.copy_(self.padding)
        input_ids, positions, out_cache_loc, req_pool_indices, _ = self.inputs
        self.static = ForwardBatch(
            mode=ForwardMode.DECODE,
            input_ids=input_ids,
            positions=positions,
            req_pool_indices=req_pool_indices,
            seq_lens=torch.ones(max_bs, dtype=torch.int32, device=device),
            out_cache_loc=out_cache_loc,
            seq_lens_cpu=torch.ones(max_bs, dtype=torch.int32),
            extend_prefix_lens_cpu=torch.zeros(max_bs, dtype=torch.int32),
            extend_seq_lens_cpu=torch.ones(max_bs, dtype=torch.int32),
        )
        backend.init_graph_state(max_bs)
        self.samples = self.runner.tp.is_first  # the rank that samples
        if self.samples:
            # The forward's argmax, then the sampled tokens (outside the pool: every graph writes the same rows).
            self.tokens = torch.zeros(max_bs, dtype=torch.int64, device=device)
            self.sample_op = self.runner.sampler.sample
            self.widths = graph_widths(self.sample_op)
        platform = self.runner.platform
        free_before = platform.memory_info(self.runner.config.device_index)[0]
        start = time.perf_counter()
        pool = self.api.new_pool()
        sizes = sorted(self.batch_sizes, reverse=True)  # largest first: smaller graphs reuse its pool memory
        if progress:
            from tqdm.auto import tqdm

            sizes = tqdm(sizes, desc="capturing decode graphs", unit="graph")
        # A garbage collection inside a capture may destroy an unreachable old runner's graphs, and destroying a
        # graph while another is being captured invalidates that capture: collect now, and not during capture.
        gc.collect()
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            self._capture_all(sizes, pool)
        finally:
            if gc_was_enabled:
                gc.enable()
        platform.synchronize()
        used = free_before - platform.memory_info(self.runner.config.device_index)[0]
        logger.info(
            "captured %d decode graphs (batch sizes %d..%d) in %.1f s, using %.0f MiB (%.0f MiB reserved); of "
            "which %d sampler graphs (short lists %s, and logprobs) in %.1f s",
            len(self.graphs),
            min(self.graphs),
            max(self.graphs),
            time.perf_counter() - start,
            used / 2**20,
            self.reserved_bytes() / 2**20,
            sum(len(by_width) for by_width in self.samplers.values()) + len(self.logprob_graphs),
            list(self.widths),
            self.sampler_capture_s,
        )

    def _capture_all(self, sizes: Iterable[int], pool: Any) -> None:
        backend, platform = self.runner.attention, self.runner.platform
        with torch.inference_mode():
            for bs in sizes:
                batch = self._static_batch(bs)
                backend.init_forward_metadata_capture(batch)
                for _ in range(2):  # warm up outside the graph: lazy init, kernel compilation, workspaces
                    self._run_model(batch)
                platform.synchronize()
                graph = self.api.new_graph()
                with self.api.capture(graph, pool=pool):
                    logits = self._run_model(batch)
                self.graphs[bs] = (graph, logits, batch)
                if self.samples:
                    self._capture_samplers(bs, logits, pool)

    def _run_model(self, batch: ForwardBatch) -> torch.Tensor:
        """What a graph holds: seq_lens from the static inputs (int64 to the kernels' int32), then the model, and
        on the rank that samples each row's argmax (a greedy step's tokens)."""
        batch.seq_lens.copy_(self.inputs[4, : batch.batch_size])
        logits = self.runner.run_model(batch)
        if self.samples:
            self.tokens[: batch.batch_size].copy_(self.runner.sampler.greedy(logits))
        return logits

    def _capture_samplers(self, bs: int, logits: torch.Tensor, pool: Any) -> None:
        """The sampler's graphs of batch size `bs` over the logits its forward graph leaves (each warmed up first:
        a kernel compiles outside the capture)."""
        if not hasattr(self, "sampling"):
            self.vocab = logits.shape[-1]
            self.sampling = padding_rows(self.max_batch_size, self.vocab).to(self.runner.device)
        start = time.perf_counter()
        tokens, params = self.tokens[:bs], self.sampling[:, :bs]

        def sample(width: int) -> None:
            batch = graph_batch(params, width)
            torch.where(batch.greedy, tokens, self.sample_op(logits, batch), out=tokens)

        def logprobs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            return token_logprobs(logits, tokens, GRAPH_TOP_LOGPROBS)

        self.samplers[bs] = {width: self._capture(functools.partial(sample, width), pool)[0] for width in self.widths}
        self.logprob_graphs[bs] = self._capture(logprobs, pool)
        self.sampler_capture_s += time.perf_counter() - start

    def _capture(self, fn: Callable[[], Any], pool: Any) -> tuple[Any, Any]:
        fn()
        self.runner.platform.synchronize()
        graph = self.api.new_graph()
        with self.api.capture(graph, pool=pool):
            out = fn()
        return graph, out

    def _static_batch(self, bs: int) -> ForwardBatch:
        s = self.static
        return ForwardBatch(
            mode=ForwardMode.DECODE,
            input_ids=s.input_ids[:bs],
            positions=s.positions[:bs],
            req_pool_indices=s.req_pool_indices[:bs],
            seq_lens=s.seq_lens[:bs],
            out_cache_loc=s.out_cache_loc[:bs],
            seq_lens_cpu=s.seq_lens_cpu[:bs],
            extend_prefix_lens_cpu=s.extend_prefix_lens_cpu[:bs],
            extend_seq_lens_cpu=s.extend_seq_lens_cpu[:bs],
        )

    # --- replay ---
    def can_run(self, batch: ForwardBatch) -> bool:
        return batch.mode is ForwardMode.DECODE and bool(self.graphs) and batch.batch_size <= self.max_batch_size

    def serves_sampling(self) -> bool:
        """Whether steps may sample in these graphs: captured with the sampler's graphs, switched on, and the
        sampler still calls the op they hold (a benchmark may swap it)."""
        return self.samples and self.sample_in_graph and self.runner.sampler.sample is self.sample_op

    def padded_size(self, batch_size: int) -> int:
        """The captured batch size a batch of `batch_size` replays with."""
        return self.batch_sizes[bisect.bisect_left(self.batch_sizes, batch_size)]

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        bs = batch.batch_size
        padded = self.padded_size(bs)
        packed = batch.decode_inputs()
        if packed is not None:
            self.inputs[:, :bs].copy_(packed)
        else:
            rows = (batch.input_ids, batch.positions, batch.out_cache_loc, batch.req_pool_indices, batch.seq_lens)
            for row, values in zip(self.inputs, rows, strict=True):
                row[:bs].copy_(values)
        if padded > bs:
            self.inputs[:, bs:padded].copy_(self.padding[:, : padded - bs])
        graph, logits, _ = self.graphs[padded]
        # The backend refreshes its own static metadata (or, reading the static batch, has nothing to copy).
        self.runner.attention.init_forward_metadata_replay(batch, padded)
        graph.replay()
        return logits[:bs]

    def sample_replayed(self, batch_size: int, step: GraphStep) -> SampleOutput:
        """The tokens (and logprobs) of the step `replay` just ran, as `step` asks: greedy rows alone read the
        forward's argmax; sampled ones copy their parameters in and replay the sampler of the step's list width.
        The outputs are static tensors, valid until the next step replays."""
        padded = self.padded_size(batch_size)
        if step.width is not None:
            self.sampling[:, :padded].copy_(step.host, non_blocking=True)
            self.samplers[padded][step.width].replay()
        tokens = self.tokens[:batch_size]
        if step.max_logprobs < 0:
            return SampleOutput(token_ids=tokens)
        graph, (chosen, top_ids, top_values) = self.logprob_graphs[padded]
        graph.replay()
        if step.max_logprobs == 0:
            return SampleOutput(token_ids=tokens, logprobs=chosen[:batch_size])
        n = min(step.max_logprobs, self.vocab)
        return SampleOutput(tokens, chosen[:batch_size], top_ids[:batch_size, :n], top_values[:batch_size, :n])
