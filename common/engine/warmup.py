"""Ready means warm: before an LLM returns (and so before `omnirun serve` answers /health with 200), run once what
compiles on first use, so that no user's request waits for a compiler.

What compiles or loads lazily: the Triton kernels (each new specialisation on first launch), the prefill attention
and KV store at a full chunk and at short prompts, eager decode at small batches, the sampling kernel for every
combination of its filters and the penalties kernel with and without prompt marks; and the vendor GEMM library's
kernels, which it picks by the token count and loads on first use, so one prompt of each power of two up to a
chunk prefills, and a batch of several. Decode at each captured batch size ran when the graphs were captured. Triton
keeps what it compiled in its cache (~/.triton/cache, or $TRITON_CACHE_DIR): a deployment that keeps that folder
between restarts (a mounted volume) warms up in seconds.

The warm-up leaves no trace a user could see: its prompts leave the prefix cache, the prefill counters (/metrics)
start at zero, and the decode-step log that `omnirun bench` reads starts empty.
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from typing import TYPE_CHECKING

import torch

from omnirun.sampling import SamplingBatch, SamplingParams, TokenHistory

if TYPE_CHECKING:
    from omnirun.engine.llm import LLM

logger = logging.getLogger(__name__)

# Short prompts in one batch: both of Triton's integer specialisations (a multiple of 16 and not) at prefill, and
# the eager decode batches they make.
_SHORT_PROMPTS = (16, 16, 5)
_NEW_TOKENS = 3


def warm_up(llm: LLM) -> float:
    """Run the warm-up through `llm`'s engine and sampler; the seconds it took."""
    start = time.perf_counter()
    engine, runner = llm.engine, llm.runner
    vocab = runner.shape.vocab_size
    rng = random.Random(0)

    def prompt(length: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(length)]

    def prefill(lengths: list[int]) -> None:
        """The prompts in one prefill, all of it computed: nothing found in the prefix cache."""
        if engine.prefix_cache is not None:
            engine.prefix_cache.flush()
        llm.generate([prompt(n) for n in lengths], greedy, use_tqdm=False)

    greedy = SamplingParams(temperature=0, max_new_tokens=_NEW_TOKENS, ignore_eos=True)
    longest = max(runner.context_length - _NEW_TOKENS, 1)  # a prompt and its new tokens fit in the context
    # The largest prefill the scheduler makes: one whole chunk (within the context and half the KV pool).
    chunk = min(engine.scheduler.chunked_prefill_size, longest, runner.kv.total_tokens // 2)
    prefill([max(chunk, 1)])
    for length in _powers_of_two(16, chunk // 2):
        prefill([length])
    prefill([max(chunk // 8, 1)] * 4)
    prefill([min(n, longest) for n in _SHORT_PROMPTS])
    _warm_sampler(llm, vocab)
    if engine.prefix_cache is not None:
        engine.prefix_cache.flush()
    engine.decode_steps.clear()
    engine.scheduler.num_prefill_tokens = engine.scheduler.num_cached_tokens = 0  # /metrics counts from here
    runner.platform.synchronize()
    seconds = time.perf_counter() - start
    logger.info("warmed up in %.1f s", seconds)
    return seconds


def _warm_sampler(llm: LLM, vocab: int) -> None:
    """The sampler once for every combination of top-k, top-p and min-p (each a specialisation of a sampling
    kernel), with penalties and logprobs, on random logits of the model's shape."""
    runner = llm.runner
    logits = torch.randn(2, vocab, device=runner.device).to(runner.dtype)
    for top_k, top_p, min_p in itertools.product((-1, 20), (1.0, 0.9), (0.0, 0.05)):
        params = [SamplingParams(temperature=0.8, top_k=top_k, top_p=top_p, min_p=min_p, seed=1), SamplingParams()]
        runner.sampler(logits, SamplingBatch.build(params, [0, 0], runner.device, vocab_size=vocab))
    history = TokenHistory(prompt_ids=[[1, 2], [3]], output_ids=[[4], []])
    for repetition in (1.1, 1.0):  # with and without the prompt's marks
        penalised = SamplingParams(temperature=0.8, frequency_penalty=0.5, repetition_penalty=repetition, logprobs=2)
        runner.sampler(logits, SamplingBatch.build([penalised] * 2, [1, 0], runner.device, vocab, history))


def _powers_of_two(low: int, high: int) -> list[int]:
    """low, 2 low, 4 low, ... up to high."""
    sizes = []
    while low <= high:
        sizes.append(low)
        low *= 2
    return sizes
