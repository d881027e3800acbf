"""Helpers for checking omnirun against HF transformers: tiny random configs of every supported architecture,
and a greedy driver that runs prompts step by step through a ModelRunner (the runner-level reference).

Used by the conformance suite that every lane (and every out-of-tree platform) runs.
"""

from __future__ import annotations

import selectors
import subprocess
from collections.abc import Sequence
from pathlib import Path

import torch

from omnirun.batch import build_batch
from omnirun.config import RunnerConfig
from omnirun.layers.ops import Ops
from omnirun.memory import KVMemory
from omnirun.platform import Platform
from omnirun.runner import ModelRunner

_COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=256,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)


def tiny_configs() -> dict[str, object]:
    """One config per supported architecture, each exercising what sets it apart from plain Llama."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    llama3_rope = dict(
        rope_type="llama3",
        rope_theta=500000.0,
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=64,
    )
    return {
        # llama3 rope scaling, GQA
        "llama": LlamaConfig(**_COMMON, rope_parameters=llama3_rope, architectures=["LlamaForCausalLM"]),
        # qkv bias; the second layer slides (window 16), the first does not
        "qwen2": Qwen2Config(
            **_COMMON,
            use_sliding_window=True,
            sliding_window=16,
            max_window_layers=1,
            architectures=["Qwen2ForCausalLM"],
        ),
        # q/k norm, explicit head_dim != hidden/heads, tied embeddings
        "qwen3": Qwen3Config(**_COMMON, head_dim=32, tie_word_embeddings=True, architectures=["Qwen3ForCausalLM"]),
        # sliding window on every layer
        "mistral": MistralConfig(**_COMMON, sliding_window=16, architectures=["MistralForCausalLM"]),
    }


ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral")


def tiny_moe_configs() -> dict[str, object]:
    """One config per supported mixture-of-experts architecture, each exercising what sets its routing apart."""
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    experts = dict(num_experts_per_tok=2, **{**_COMMON, "num_hidden_layers": 3})
    return {
        # top-2 of 8, the weights always renormalised; sliding window
        "mixtral": MixtralConfig(
            **experts, num_local_experts=8, sliding_window=16, architectures=["MixtralForCausalLM"]
        ),
        # a shared expert behind a sigmoid gate, weights not renormalised, a dense MLP on layer 1
        "qwen2_moe": Qwen2MoeConfig(
            **experts,
            num_experts=6,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            norm_topk_prob=False,
            mlp_only_layers=[1],
            architectures=["Qwen2MoeForCausalLM"],
        ),
        # q/k norm, renormalised top-k, experts on every second layer only
        "qwen3_moe": Qwen3MoeConfig(
            **experts,
            head_dim=32,
            num_experts=8,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            decoder_sparse_step=2,
            architectures=["Qwen3MoeForCausalLM"],
        ),
    }


MOE_ARCHITECTURES = ("mixtral", "qwen2_moe", "qwen3_moe")


def tiny_hf_model(arch: str, seed: int = 1234, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A random HF model of the tiny config for `arch` (one of ARCHITECTURES or MOE_ARCHITECTURES), with no constant
    tensor in it."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    configs = tiny_moe_configs() if arch in MOE_ARCHITECTURES else tiny_configs()
    model = AutoModelForCausalLM.from_config(configs[arch], dtype=dtype).eval()
    randomize_constant_parameters(model, seed)
    return model


def randomize_constant_parameters(model: torch.nn.Module, seed: int) -> list[str]:
    """Give random values to every parameter HF's init left constant, and return their names.

    HF zeroes biases and sets norm weights to one: a model that dropped a bias, or a norm's weight, would still
    match. Adding U(-0.5, 0.5) turns zeros into small random biases and ones into scales in (0.5, 1.5), for any
    architecture, present or future, without knowing its parameter names.
    """
    gen = torch.Generator().manual_seed(seed)
    changed = []
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.numel() > 1 and bool((param == param.flatten()[0]).all()):
                noise = torch.rand(param.shape, generator=gen) - 0.5
                param.add_(noise.to(param.device, param.dtype))
                changed.append(name)
    return changed


# The quantized ops whose weights the platform may re-lay (a `prepare_` hook), and how many of the tensors after x
# (and the router logits, for a mixture) the hook is given; fp8_fused_moe reads them as loaded.
PREPARED = {"fp8_linear": 2, "int4_linear": 3, "int4_fused_moe": 6}


def keeping_quantized(platform: Platform, *ops: str) -> Platform:
    """`platform` offering the references of the quantized ops `ops` ("fp8_linear", "int4_linear", "fp8_fused_moe",
    "int4_fused_moe") as if they were its kernels: layers then keep a checkpoint's quantized weights where the device
    has no kernel for them, so that the kept path (loading, sharding, the op's calls) is tested on any device. Calls
    are counted per op in the returned platform's `calls`. The `prepare_` hooks of the ops in PREPARED are offered
    too: each copies the tensors it is given, and the op checks that the `prepared` it receives equals the tensors
    it multiplies by (so a form left stale by a weight update fails)."""

    class KeepsQuantized(type(platform)):
        calls = dict.fromkeys(ops, 0)

        def device_fused_ops(self):
            def counted(name: str):
                reference = getattr(Ops(), name)
                first = 1 if name.endswith("fused_moe") else 0  # a mixture's weights follow the router logits
                weights = slice(first, first + PREPARED.get(name, 0))

                def op(x, *args):
                    prepared = args[-1]  # layers pass it last
                    if name in PREPARED and (
                        not isinstance(prepared, tuple) or not all(map(torch.equal, prepared, args[weights]))
                    ):
                        raise AssertionError(f"{name} was not given the prepared form of its current weights")
                    type(self).calls[name] += 1
                    return reference(x, *args)

                return op

            def prepare(*args):
                return tuple(arg.clone() for arg in args if isinstance(arg, torch.Tensor))

            hooks = {f"prepare_{name}": prepare for name in ops if name in PREPARED}
            return {**super().device_fused_ops(), **{name: counted(name) for name in ops}, **hooks}

    return KeepsQuantized()


def keeping_fp8(platform: Platform) -> Platform:
    """`platform` offering the references of `fp8_linear` and `fp8_fused_moe` as its kernels (keeping_quantized)."""
    return keeping_quantized(platform, "fp8_linear", "fp8_fused_moe")


def keeping_int4(platform: Platform) -> Platform:
    """`platform` offering the references of `int4_linear` and `int4_fused_moe` as its kernels (keeping_quantized)."""
    return keeping_quantized(platform, "int4_linear", "int4_fused_moe")


def make_runner(platform: Platform, model: Path | str, **flags) -> ModelRunner:
    """A runner on `platform` with a small KV pool, float32 and no progress bars unless overridden."""
    flags = {"max_total_tokens": 4096, "progress": False, "dtype": "float32", **flags}
    return ModelRunner(RunnerConfig(model=str(model), device=platform.name, **flags), platform=platform)


def replayed_and_eager(runner: ModelRunner, prompts: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits of one decode step after `prompts`, replayed from the runner's graphs and run eagerly (the eager
    step rewrites the same K/V slots with the same values). The rows stay taken: a test's runner is thrown away."""
    rows = [runner.kv.new_request() for _ in prompts]
    runner.forward(build_batch(runner.kv, rows, [0] * len(prompts), prompts, runner.device))
    lens = [len(p) for p in prompts]
    batch = build_batch(runner.kv, rows, lens, [[7 + i] for i in range(len(prompts))], runner.device)
    assert runner.graph_runner.can_run(batch)
    replayed = runner.forward(batch).clone()
    return replayed, runner.forward_eager(batch)


def greedy_generate(
    runner: ModelRunner,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    chunk_size: int | None = None,
) -> list[list[int]]:
    """Greedy tokens for a batch of prompts driven step by step through the runner (prefill, then decode).

    With `chunk_size`, prompts are prefilled in chunks of that many tokens (each chunk attends to the cached
    earlier ones). Rows are released at the end, so the pool is as it was before.
    """
    kv = runner.kv
    rows = [kv.new_request() for _ in prompts]
    try:
        cached = [0] * len(prompts)
        chunk = chunk_size or max(len(p) for p in prompts)
        logits = None
        while any(c < len(p) for c, p in zip(cached, prompts, strict=True)):
            step = [i for i, p in enumerate(prompts) if cached[i] < len(p)]
            new = [list(prompts[i][cached[i] : cached[i] + chunk]) for i in step]
            batch = build_batch(kv, [rows[i] for i in step], [cached[i] for i in step], new, runner.device)
            assert batch is not None, "the test pool should hold every prompt"
            step_logits = runner.forward(batch)
            if logits is None:
                logits = torch.empty(len(prompts), step_logits.shape[-1], dtype=step_logits.dtype, device=runner.device)
            logits[step] = step_logits
            for i, ids in zip(step, new, strict=True):
                cached[i] += len(ids)
        outputs: list[list[int]] = [[] for _ in prompts]
        while True:
            tokens = logits.argmax(-1).tolist()
            for out, token in zip(outputs, tokens, strict=True):
                out.append(token)
            if len(outputs[0]) == max_new_tokens:
                break
            batch = build_batch(kv, rows, cached, [[t] for t in tokens], runner.device)
            assert batch is not None
            logits = runner.forward(batch)
            cached = [c + 1 for c in cached]
        return outputs
    finally:
        for row in rows:
            kv.release(row)


def hf_greedy(hf_model, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([list(prompt)], device=next(hf_model.parameters()).device)
    out = hf_model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, ids.shape[1] :].tolist()


def greedy_gap(hf_model, prompt: Sequence[int], tokens: Sequence[int]) -> tuple[float, float]:
    """Teacher-forced check of greedy tokens against HF: (largest gap between HF's best logit and its logit for the
    token chosen, over every step; largest |logit|). A gap of 0 means HF would have chosen every token itself; in
    bf16 a small gap marks a near-tie that rounding decided differently, not a wrong token."""
    device = next(hf_model.parameters()).device
    ids = torch.tensor([list(prompt) + list(tokens[:-1])], device=device)
    with torch.no_grad():
        logits = hf_model(ids).logits[0, len(prompt) - 1 :].float()
    chosen = logits.gather(-1, torch.tensor(list(tokens), device=device)[:, None])[:, 0]
    return float((logits.max(-1).values - chosen).max()), float(logits.abs().max())


def fill_prefixes(kv: KVMemory, prefix_lens: list[int]) -> list[int]:
    """New requests holding `prefix_lens` cached tokens, allocated round-robin in chunks so their pages interleave."""
    rows = [kv.new_request() for _ in prefix_lens]
    held = [0] * len(rows)
    while held != prefix_lens:
        for i, row in enumerate(rows):
            end = min(prefix_lens[i], held[i] + 7)
            if end > held[i]:
                kv.alloc_tokens([row], [held[i]], [end])
                held[i] = end
    return rows


def read_line_within(process: subprocess.Popen, seconds: float) -> str:
    """The next line a child prints on its stdout (a text pipe), or an AssertionError with its stderr's tail after
    `seconds`: a child that hangs before it speaks must fail the test, never hold the whole run."""
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        if not selector.select(seconds):
            process.kill()
            stderr = process.communicate()[1] or ""
            raise AssertionError(f"no line from the child within {seconds:.0f} s:\n{stderr[-4000:]}")
    return process.stdout.readline()
