"""Sampling inside the decode graphs (omnirun.sampling.graph_form), on the lane's device with its own graphs and
`sample` kernel: a sampled decode step replayed with its sampler gives the eager sampler's tokens and logprobs on
the same logits, token for token, in mixed and padded batches over several steps; and in deterministic mode (the
logits then do not depend on the batch) a seeded request draws the same tokens alone, inside a batch, and with
the graphs off. Lanes without graphs, or whose `sample` op serves none, skip."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
import torch

from omnirun.batch import build_batch
from omnirun.engine.engine import Engine
from omnirun.errors import ConfigError
from omnirun.sampling import SampleOutput, SamplingParams
from omnirun.testing import make_runner

MIXED = (
    dict(temperature=0),
    dict(temperature=0.8),
    dict(temperature=1.1, top_k=5),
    dict(temperature=0.9, top_k=200),  # a list wider than the narrow one
    dict(temperature=1.3, top_p=0.8),  # top-p alone: the long list
    dict(temperature=1.0, min_p=0.05),
    dict(temperature=0.7, top_k=20, top_p=0.9, min_p=0.02),
    dict(temperature=1.0, top_k=1),  # greedy by top-k
)


def mixed_params(rng: random.Random, rows: int, logprobs: bool = True) -> list[SamplingParams]:
    """Greedy, temperature, top-k (short and long), top-p, min-p and their mixes, seeded or not, some with
    logprobs (the chosen token's, or the top 1, 5 or 20 too)."""
    params = []
    for _ in range(rows):
        kind = dict(rng.choice(MIXED))
        if rng.random() < 0.6:
            kind["seed"] = rng.randrange(2**40)
        if logprobs and rng.random() < 0.4:
            kind["logprobs"] = rng.choice([0, 1, 5, 20])
        params.append(SamplingParams(**kind))
    return params


def assert_same_output(graph: SampleOutput, eager: SampleOutput) -> None:
    assert torch.equal(graph.token_ids.cpu(), eager.token_ids.cpu()), (graph.token_ids, eager.token_ids)
    for name in ("logprobs", "top_logprob_ids", "top_logprobs"):
        got, want = getattr(graph, name), getattr(eager, name)
        assert (got is None) == (want is None), name
        if got is not None:
            assert torch.equal(got.cpu(), want.cpu()), name


def graph_and_eager_steps(
    runner, prompts: Sequence[Sequence[int]], steps: Sequence[Sequence[SamplingParams]], token_index: int = 0
) -> None:
    """Decode steps of `prompts` through `runner.forward_and_sample`, each compared with the eager sampler on its
    logits (torch's RNG set alike before each, for the unseeded rows' keys); its tokens feed the next step."""
    rows = [runner.kv.new_request() for _ in prompts]
    runner.forward(build_batch(runner.kv, rows, [0] * len(prompts), prompts, runner.device))
    lens = [len(p) for p in prompts]
    tokens = [[3 + i] for i in range(len(prompts))]
    try:
        for step, params in enumerate(steps):
            batch = build_batch(runner.kv, rows, lens, tokens, runner.device)
            assert runner.graph_runner.can_run(batch)
            index = [token_index + step] * len(prompts)
            torch.manual_seed(100 + step)
            logits, graph = runner.forward_and_sample(batch, params, index)
            logits = logits.clone()  # the outputs are the graphs' static tensors: kept past the next step
            graph = SampleOutput(*(None if t is None else t.clone() for t in vars(graph).values()))
            torch.manual_seed(100 + step)
            assert_same_output(graph, runner.sample(logits, params, index))
            tokens = [[t] for t in graph.token_ids.tolist()]
            lens = [n + 1 for n in lens]
    finally:
        for row in rows:
            runner.kv.release(row)


def _skip_without_graphs(platform) -> None:
    if platform.graph_api() is None:
        pytest.skip(f"{platform.name} has no graph API: every step runs eagerly")


def _graph_runner_or_skip(runner, platform, dtype):
    graphs = runner.graph_runner
    if graphs is None or not graphs.graphs:
        pytest.skip(f"{platform.name} builds no graph runner for {dtype}: every step runs eagerly")
    if not graphs.widths:
        pytest.skip(f"{platform.name}'s sample op serves no graph: sampled steps sample eagerly")
    return graphs


@pytest.mark.parametrize("dtype", ["float32", "half"])
@pytest.mark.parametrize("batch_size", [1, 3, 8])  # 3 replays the graph of 4, padded
def test_sampling_in_the_graph_equals_the_eager_sampler(platform, tiny_checkpoints, batch_size, dtype):
    _skip_without_graphs(platform)
    if dtype == "half":
        halves = [d for d in platform.capabilities.model_dtypes if d.itemsize == 2]
        if not halves:
            pytest.skip(f"{platform.name} computes in no half dtype")
        dtype = str(halves[0]).removeprefix("torch.")
    runner = make_runner(platform, tiny_checkpoints["qwen2"].plain, max_running_requests=16, dtype=dtype)
    graphs = _graph_runner_or_skip(runner, platform, dtype)
    rng = random.Random(batch_size)
    prompts = [[rng.randrange(1, 256) for _ in range(3 + 2 * i)] for i in range(batch_size)]
    replays = sum(getattr(g, "replays", 0) for by_width in graphs.samplers.values() for g in by_width.values())
    steps = [mixed_params(rng, batch_size) for _ in range(3)]
    graph_and_eager_steps(runner, prompts, steps)
    sampled = sum(not all(p.greedy for p in params) for params in steps)
    after = sum(getattr(g, "replays", 0) for by_width in graphs.samplers.values() for g in by_width.values())
    if hasattr(next(iter(graphs.graphs.values()))[0], "replays"):  # a graph that counts its replays
        assert after - replays == sampled


def test_a_seeded_request_draws_the_same_tokens_alone_in_batches_and_eagerly(platform, tiny_checkpoints):
    """Deterministic mode, so that a row's logits do not depend on its batch: what is left to differ is the
    sampler, in the graph or not."""
    _skip_without_graphs(platform)
    try:
        runner = make_runner(
            platform, tiny_checkpoints["qwen2"].plain, max_running_requests=16, dtype="float32", deterministic=True
        )
    except ConfigError as exc:
        pytest.skip(f"{platform.name} has no deterministic mode here: {exc}")
    _graph_runner_or_skip(runner, platform, "deterministic float32")
    seeded = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, min_p=0.01, seed=1234, max_new_tokens=8)
    prompt = [11, 12, 13, 14, 15]
    rng = random.Random(0)

    def generate(engine, prompts, params):
        requests = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
        while engine.has_work:
            engine.step()
        return [list(r.output_ids) for r in requests]

    def others(n):
        params = mixed_params(rng, n, logprobs=False)
        for p in params:
            p.max_new_tokens = rng.randint(1, 10)
        return [[rng.randrange(1, 256) for _ in range(rng.randint(2, 9))] for _ in range(n)], params

    alone = generate(Engine(runner), [prompt], [seeded])[0]
    for n in (3, 7):
        prompts, params = others(n)
        at = rng.randint(0, n)
        out = generate(Engine(runner), prompts[:at] + [prompt] + prompts[at:], params[:at] + [seeded] + params[at:])
        assert out[at] == alone
    graphs, runner.graph_runner = runner.graph_runner, None
    try:
        prompts, params = others(4)
        assert generate(Engine(runner), prompts + [prompt], params + [seeded])[-1] == alone
    finally:
        runner.graph_runner = graphs
