"""The Python API, in the style vLLM users know: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from omnirun.config import RunnerConfig
from omnirun.engine.engine import Engine
from omnirun.engine.request import Request, RequestOutput
from omnirun.errors import ConfigError, ModelLoadError
from omnirun.runner import ModelRunner
from omnirun.sampling import SamplingParams

logger = logging.getLogger(__name__)

Prompt = str | Sequence[int]
_RUNNER_FLAGS = {field.name for field in dataclasses.fields(RunnerConfig)} - {"model"}
_ENGINE_FLAGS = {"max_prefill_tokens", "chunked_prefill_size", "disable_overlap_schedule"}


@dataclasses.dataclass
class StreamDelta:
    """What one step added to a streamed request."""

    request_id: int
    token_ids: list[int]  # the new token(s)
    text: str | None  # the new text (None without a tokenizer); may lag a token behind (partial UTF-8, stop strings)
    finish_reason: str | None


class LLM:
    """One model on one device, with a continuous-batching engine.

    `model` is an HF model directory (or, with load_format="dummy", a preset name); None runs the small model
    embedded in the package (random weights: its text is nonsense). Other keyword arguments are the runner's and
    engine's flags: device, dtype, kv_cache_dtype, page_size, mem_fraction_static, max_total_tokens,
    max_running_requests, attention_backend, load_format, seed, max_prefill_tokens, chunked_prefill_size,
    disable_overlap_schedule, ...
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
        runner_flags = {k: v for k, v in flags.items() if k in _RUNNER_FLAGS}
        engine_flags = {k: v for k, v in flags.items() if k in _ENGINE_FLAGS}
        if engine_flags.pop("disable_overlap_schedule", False):
            engine_flags["overlap_schedule"] = False
        self.runner = ModelRunner(RunnerConfig(model=model, **runner_flags))
        self.tokenizer = _load_tokenizer(tokenizer or model)
        self.engine = Engine(
            self.runner, tokenizer=self.tokenizer, eos_token_ids=_eos_token_ids(self.runner, model), **engine_flags
        )

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ConfigError("text prompts need a tokenizer: pass token ids, or tokenizer=<HF tokenizer dir>")
            return list(self.tokenizer(prompt).input_ids)
        return [int(t) for t in prompt]

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs come back in the prompts' order."""
        prompts = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompts))
        requests = [self.engine.add_request(self.encode(p), sp) for p, sp in zip(prompts, params, strict=True)]
        bar = None
        if use_tqdm and len(requests) > 1:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(requests), desc="generating", unit="req")
        while self.engine.has_work:
            finished = sum(r.finished for r in self.engine.step())
            if bar is not None and finished:
                bar.update(finished)
        if bar is not None:
            bar.close()
        return [RequestOutput.of(r, self.engine.text_of(r)) for r in requests]

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[StreamDelta]:
        """Yield the tokens (and text) of one prompt as they are produced."""
        request = self.engine.add_request(self.encode(prompt), sampling_params or SamplingParams())
        emitted_tokens, emitted_text = 0, 0
        while not request.finished:
            self.engine.step()
            if len(request.output_ids) == emitted_tokens:
                continue
            text_delta = None
            if self.tokenizer is not None:
                text = self.engine.text_of(request)
                ready = _streamable_length(text, request)
                text_delta, emitted_text = text[emitted_text:ready], max(emitted_text, ready)
            new_tokens = request.output_ids[emitted_tokens:]
            emitted_tokens = len(request.output_ids)
            reason = request.finish_reason.value if request.finished else None
            yield StreamDelta(request.request_id, new_tokens, text_delta, reason)


def _streamable_length(text: str, request: Request) -> int:
    """How much of the text can be shown now: all of it once finished; otherwise hold back a trailing partial
    UTF-8 character and anything that could still turn out to be the start of a stop string."""
    if request.finished:
        return len(text)
    ready = len(text.rstrip("\ufffd"))
    if request.params.stop:
        ready -= max(len(s) for s in request.params.stop) - 1
    return max(ready, 0)


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
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


def _load_tokenizer(source: str) -> Any | None:
    """The HF tokenizer in `source` (a directory or hub-style name already on disk), or None when there is none."""
    path = Path(source)
    if not path.is_dir() or not any(path.glob("tokenizer*")):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:  # transformers raises many kinds
        raise ModelLoadError(f"cannot load the tokenizer in {path}: {str(exc).splitlines()[0]}") from exc


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
