"""The Python API, in the style vLLM users know: `LLM(model=...).generate(prompts, SamplingParams(...))`.

An LLM owns a ModelRunner and an Engine stepped by one background thread (EngineLoop); `generate`, `stream`,
`abort` and the weight calls are safe from any number of threads, whose requests join one running batch.
`close()` (or leaving a `with LLM(...) as llm:` block) gives every byte of device memory back.
"""

from __future__ import annotations

import dataclasses
import logging
import numbers
import weakref
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from omnirun.config import RunnerConfig
from omnirun.engine.engine import Engine, KVUsage
from omnirun.engine.loop import Channel, EngineLoop, StreamDelta
from omnirun.engine.request import RequestOutput
from omnirun.engine.tokenizer import load_tokenizer, tokenizer_dir
from omnirun.engine.warmup import warm_up
from omnirun.errors import ConfigError, EngineClosedError
from omnirun.kernels import offers_triton
from omnirun.launch import start_runner
from omnirun.platform import Platform
from omnirun.registry import select_platform
from omnirun.runner import ModelRunner
from omnirun.sampling import SamplingParams

logger = logging.getLogger(__name__)

Prompt = str | Sequence[int]
_RUNNER_FLAGS = {field.name for field in dataclasses.fields(RunnerConfig)} - {"model"}
_ENGINE_FLAGS = {
    "max_prefill_tokens",
    "chunked_prefill_size",
    "disable_overlap_schedule",
    "disable_prefix_caching",
    "warmup",
}


class LLM:
    """One model on one device, with a continuous-batching engine.

    `model` is an HF model directory (or, with load_format="dummy", a preset name); None runs the small model
    embedded in the package (random weights: its text is nonsense). Other keyword arguments are the runner's and
    engine's flags: device, dtype, kv_cache_dtype, page_size, mem_fraction_static, max_total_tokens,
    max_running_requests, attention_backend, load_format, seed, max_prefill_tokens, chunked_prefill_size,
    disable_overlap_schedule, disable_prefix_caching, warmup, ...

    Ready means warm (omnirun.engine.warmup): `warmup` None (the default) runs a warm-up before the LLM returns
    where the device compiles Triton kernels on first use; True runs it anywhere, False nowhere. `warmup_s` says
    how long it took (None: none ran).
    """

    def __init__(self, model: str | None = None, *, tokenizer: str | None = None, **flags: Any):
        flags = {k: v for k, v in flags.items() if v is not None}  # None: "not given", the default applies
        unknown = sorted(set(flags) - _RUNNER_FLAGS - _ENGINE_FLAGS)
        if unknown:
            raise ConfigError(f"unknown LLM argument(s) {', '.join(unknown)}: see omnirun.config.RunnerConfig")
        if model is None:
            from omnirun.assets.default_model import default_model_dir

            model = default_model_dir()
            logger.info("no model given: running the embedded default model (random weights, nonsense text)")
        # --device is resolved here, once (a name, $OMNIRUN_DEVICE or auto), unless the caller resolved it already
        # and passes the Platform; the runner and the launcher use this object.
        platform = flags.pop("device") if isinstance(flags.get("device"), Platform) else None
        if platform is None:
            platform = select_platform(flags.get("device"))
        flags["device"] = platform.name
        runner_flags = {k: v for k, v in flags.items() if k in _RUNNER_FLAGS}
        engine_flags = {k: v for k, v in flags.items() if k in _ENGINE_FLAGS}
        for name in ("max_prefill_tokens", "chunked_prefill_size"):
            if name in engine_flags and engine_flags[name] < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {engine_flags[name]}")
        if engine_flags.pop("disable_overlap_schedule", False):
            engine_flags["overlap_schedule"] = False
        if engine_flags.pop("disable_prefix_caching", False):
            engine_flags["prefix_caching"] = False
        warmup = engine_flags.pop("warmup", None)
        config = RunnerConfig(model=str(model), **runner_flags)  # checks the flags before anything loads
        source = tokenizer_dir(tokenizer, config.model)
        self.tokenizer = load_tokenizer(source) if source is not None else None
        # One device, or rank 0 of a tensor-parallel group (under torchrun, other ranks serve inside this call and
        # then exit the process: only rank 0 gets past it).
        self.runner = start_runner(config, platform)
        try:
            self.engine = Engine(
                self.runner,
                tokenizer=self.tokenizer,
                eos_token_ids=_eos_token_ids(self.runner, config.model),
                **engine_flags,
            )
            self._loop = EngineLoop(self.engine)
        except BaseException:
            self.runner.close()
            raise
        # close() at the latest when the LLM is collected or the interpreter exits (the engine thread is joined
        # before the device memory goes).
        self._close = weakref.finalize(self, _close, self._loop, self.engine)
        self.warmup_s: float | None = None
        if warmup is None:  # by default where kernels compile on first use
            warmup = offers_triton(self.runner.capabilities)
        if warmup:
            try:
                self.warmup_s = warm_up(self)
            except BaseException:
                self.close()
                raise

    # --- lifecycle ---
    def close(self) -> None:
        """Stop the engine (live requests end with finish reason "abort") and give back the device memory: KV
        pool, graphs, weights, process group. Idempotent; the LLM takes no requests afterwards."""
        self._close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return not self._close.alive

    @property
    def engine_loop(self) -> EngineLoop:
        """The thread that steps the engine: what an asynchronous front (the HTTP server) submits requests to."""
        return self._loop

    def _check_open(self) -> None:
        if self.closed:
            raise EngineClosedError("this LLM is closed: create a new one")

    # --- requests ---
    def encode(self, prompt: Prompt) -> list[int]:
        return encode_prompt(self.tokenizer, prompt)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs come back in the prompts' order.

        Every prompt is checked before any is queued. Other threads' requests run in the same batches. If this
        call is interrupted (Ctrl-C) or fails, its unfinished requests are aborted and the LLM stays usable.
        """
        self._check_open()
        prompts = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompts))
        requests = [self.engine.make_request(self.encode(p), sp) for p, sp in zip(prompts, params, strict=True)]
        channel = Channel()
        outputs: dict[int, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(requests), desc="generating", unit="req")
        try:
            for request in requests:
                self._loop.submit(request, channel)
            while len(outputs) < len(requests):
                request_id, item = self._loop.receive(channel, idle=bar.refresh if bar is not None else None)
                if isinstance(item, BaseException):
                    raise item
                outputs[request_id] = item
                if bar is not None:
                    bar.update(1)
        except BaseException:
            for request in requests:
                if request.request_id not in outputs:
                    self._loop.abort(request.request_id)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [outputs[r.request_id] for r in requests]

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> RequestStream:
        """The tokens (and text) of one prompt as they are produced: an iterator of StreamDelta, the last of which
        carries the finish reason. Closing it, or dropping it unfinished, aborts the request."""
        self._check_open()
        params = sampling_params or SamplingParams()
        request = self.engine.make_request(self.encode(prompt), params, detokenize=True)
        channel = Channel()
        self._loop.submit(request, channel, stream=True)
        return RequestStream(self._loop, request.request_id, channel)

    def abort(self, request_id: int) -> None:
        """End a request (a stream's `request_id`) at the next step: finish reason "abort", its pages freed."""
        self._loop.abort(request_id)

    def kv_usage(self) -> KVUsage:
        """The KV pool's pages now: total, free, and held per live request (taken between two steps)."""
        self._check_open()
        return self._loop.call(Engine.kv_usage)

    # --- weights (between two steps; running requests then recompute their KV cache with the new weights) ---
    def update_weights_from_disk(self, model_path: str) -> None:
        self._check_open()
        self._loop.call(lambda engine: _updated(engine, engine.runner.update_weights_from_disk, model_path))

    def update_weights_from_tensor(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._check_open()
        named_tensors = list(named_tensors)
        self._loop.call(lambda engine: _updated(engine, engine.runner.update_weights_from_tensor, named_tensors))

    def get_weights_by_name(self, name: str, truncate_size: int | None = None) -> torch.Tensor:
        self._check_open()
        return self._loop.call(lambda engine: engine.runner.get_weights_by_name(name, truncate_size))

    # --- weights from a trainer (RLHF), as SGLang's API: every rank joins a group with the trainer's processes ---
    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str | None = None,
    ) -> None:
        """Join a process group with a trainer: this LLM's rank r becomes rank `rank_offset + r` of `world_size`
        (the trainer's rank 0 broadcasts). `backend` None: the device's collective backend."""
        self._check_open()
        args = (master_address, master_port, rank_offset, world_size, group_name, backend)
        self._loop.call(lambda engine: engine.runner.init_weights_update_group(*args))

    def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[torch.dtype | str],
        shapes: Sequence[Sequence[int]],
        group_name: str = "weight_update_group",
    ) -> None:
        """Receive new weights that the trainer broadcasts, one tensor per name, in order; all are checked first."""
        self._check_open()
        args = (list(names), list(dtypes), [list(s) for s in shapes], group_name)
        self._loop.call(lambda engine: _updated(engine, engine.runner.update_weights_from_distributed, *args))

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        self._check_open()
        self._loop.call(lambda engine: engine.runner.destroy_weights_update_group(group_name))


class RequestStream:
    """An iterator of one request's StreamDeltas. `close()` — or dropping it before the end — aborts the request."""

    def __init__(self, loop: EngineLoop, request_id: int, channel: Channel):
        self.request_id = request_id
        self._loop = loop
        self._channel = channel
        self._ended = False

    def __iter__(self) -> RequestStream:
        return self

    def __next__(self) -> StreamDelta:
        if self._ended:
            raise StopIteration
        try:
            _, item = self._loop.receive(self._channel)
        except BaseException:  # Ctrl-C or a dead engine: the request must not run on unseen
            self.close()
            raise
        if isinstance(item, BaseException):
            self._ended = True
            raise item
        self._ended = item.finish_reason is not None
        return item

    def close(self) -> None:
        if not self._ended:
            self._ended = True
            self._loop.abort(self.request_id)

    def __enter__(self) -> RequestStream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()


def encode_prompt(tokenizer: Any, prompt: Prompt) -> list[int]:
    """A prompt's token ids: a text through the tokenizer (None: ConfigError), or ids checked to be ints."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ConfigError("text prompts need a tokenizer: pass token ids, or tokenizer=<HF tokenizer dir>")
        return list(tokenizer(prompt).input_ids)
    if hasattr(prompt, "tolist"):  # a torch tensor or a numpy array of ids
        prompt = prompt.tolist()

    def refuse(bad: object, where: str = "") -> ConfigError:
        shown = " ".join(repr(bad).split())
        shown = shown if len(shown) <= 60 else shown[:57] + "..."  # one line, however large the value
        return ConfigError(
            f"a prompt is a string or a list of int token ids, got {shown} ({type(bad).__name__}){where}"
        )

    # (bytes and dicts iterate as ints, which would pass for token ids)
    if not isinstance(prompt, Sequence) or isinstance(prompt, (bytes, bytearray)):
        raise refuse(prompt)
    for i, token in enumerate(prompt):
        if not _is_token_id(token):
            raise refuse(token, f" at position {i}")
    return [int(t) for t in prompt]


def _close(loop: EngineLoop, engine: Engine) -> None:
    try:
        loop.close()
    finally:
        engine.close()


def _updated(engine: Engine, update: Any, *args: Any) -> None:
    update(*args)
    engine.recompute_all()  # KV computed with the old weights is stale


def _is_token_id(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)  # numpy ints too, never True


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(_is_token_id(t) for t in prompts):
        return [prompts]  # one prompt of token ids
    return prompts


def _as_params_list(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ConfigError(f"got {len(params)} SamplingParams for {n} prompts: pass one, or one per prompt")
    return params


def _eos_token_ids(runner: ModelRunner, model: str) -> set[int]:
    """EOS ids from config.json and, where present, generation_config.json (instruct models list several)."""
    ids: set[int] = set()
    sources = [getattr(runner.model_config, "eos_token_id", None)]
    if Path(model, "generation_config.json").is_file():
        from transformers import GenerationConfig

        sources.append(GenerationConfig.from_pretrained(model).eos_token_id)
    for eos in sources:
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(int(e) for e in eos)
    return ids
