"""Ready means warm (omnirun.engine.warmup): where kernels compile on first use, an LLM runs every specialisation a
request could meet before it returns, and leaves no trace of it."""

from __future__ import annotations

import contextlib

import torch

from omnirun.batch import ForwardMode
from omnirun.cli_flags import add_runner_flags, llm_kwargs
from omnirun.devices.cpu.platform import CpuPlatform
from omnirun.engine import LLM
from omnirun.runner import ModelRunner
from omnirun.sampling import adjust, reference
from omnirun.server.summary import engine_description, summary_line


class RecordingSampleCpu(CpuPlatform):
    """The host CPU with `sample` and `apply_penalties` ops of its own that record the filters of each batch they
    see, and whether it had prompt marks."""

    def __init__(self) -> None:
        super().__init__()
        self.sampled: list[tuple[bool, bool, bool]] = []
        self.penalised_with_prompt: list[bool] = []

    def device_fused_ops(self):
        def sample(logits: torch.Tensor, batch) -> torch.Tensor:
            self.sampled.append((batch.any_top_k, batch.any_top_p, batch.any_min_p))
            return reference.sample(logits, batch)

        def apply_penalties(logits, counts, prompt_seen, *args):
            self.penalised_with_prompt.append(prompt_seen is not None)
            return adjust.apply_penalties(logits, counts, prompt_seen, *args)

        return {**super().device_fused_ops(), "sample": sample, "apply_penalties": apply_penalties}


def test_no_warm_up_by_default_where_nothing_compiles_on_first_use():
    with contextlib.closing(LLM(device="cpu", max_total_tokens=2048)) as llm:
        assert llm.warmup_s is None  # the CPU's capabilities offer no Triton kernels


def test_the_warm_up_meets_every_sampling_kernel_and_a_whole_prefill_chunk_and_leaves_no_trace(monkeypatch):
    platform = RecordingSampleCpu()
    steps = []  # (mode, tokens) of every forward pass
    forward = ModelRunner.forward
    monkeypatch.setattr(
        ModelRunner, "forward", lambda self, b: steps.append((b.mode, b.num_tokens)) or forward(self, b)
    )
    with contextlib.closing(LLM(device=platform, warmup=True, chunked_prefill_size=96)) as llm:
        assert llm.warmup_s is not None and llm.warmup_s > 0
        assert set(platform.sampled) == {(k, p, m) for k in (False, True) for p in (False, True) for m in (False, True)}
        assert set(platform.penalised_with_prompt) == {True, False}
        # a whole chunk, a prompt of each power of two up to half of it, four prompts of an eighth of it in one
        # batch, then the short prompts in one batch, then their decode steps in one batch of 3
        assert (ForwardMode.EXTEND, 96) in steps and (ForwardMode.EXTEND, 16 + 16 + 5) in steps
        assert (ForwardMode.EXTEND, 16) in steps and (ForwardMode.EXTEND, 32) in steps
        assert (ForwardMode.EXTEND, 4 * 12) in steps
        assert (ForwardMode.DECODE, 3) in steps
        assert llm.engine.prefix_cache.pages() == [] and len(llm.engine.decode_steps) == 0
        assert llm.engine.prefill_stats().computed_tokens == 0
        assert llm.engine.requests == {}
        line = summary_line("m", "m", engine_description(llm), "http://x")
        assert f"warmup_s={llm.warmup_s:.1f}" in line


def test_a_context_shorter_than_the_warm_up_prompts_still_warms_up():
    with contextlib.closing(LLM(device="cpu", warmup=True, context_length=12, max_total_tokens=512)) as llm:
        assert llm.warmup_s is not None


def test_skip_warmup_is_a_flag_of_every_command():
    import argparse

    parser = argparse.ArgumentParser()
    add_runner_flags(parser)
    assert llm_kwargs(parser.parse_args(["--skip-warmup"]))["warmup"] is False
    assert "warmup" not in llm_kwargs(parser.parse_args([]))
