"""Sampling inside the decode graphs (omnirun.sampling.graph_form): a sampled decode step replayed with its sampler
draws the eager sampler's tokens and logprobs from the same logits, token for token, in mixed and padded batches
and over several steps; a seeded request's tokens do not depend on its batch, in the graph or eagerly; rows the
graph's sampler does not serve sample eagerly after the forward's replay, with the same result.

On the CPU with a recording graph and a capturable variant of torch_native attention (omnirun_fakes.graph_cpu); the
conformance suite's test_graph_sampling runs the same comparison on each lane's own graphs and sampling kernel."""

from __future__ import annotations

import random

import pytest
import torch

from omnirun.batch import build_batch
from omnirun.conformance.test_graph_sampling import assert_same_output, graph_and_eager_steps, mixed_params
from omnirun.engine.engine import Engine
from omnirun.sampling import SamplingParams
from omnirun.testing import make_runner, tiny_hf_model
from omnirun_fakes.graph_cpu import GraphCpu, GraphTorchNative


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    tiny_hf_model("llama").save_pretrained(path)
    runner = make_runner(
        GraphCpu(), path, attention_backend=GraphTorchNative.name, context_length=96, max_running_requests=8
    )
    assert runner.graph_runner is not None and runner.graph_runner.batch_sizes == [1, 2, 4, 8]
    yield runner
    runner.close()


class Replays:
    """Counts the replays of the sampler's graphs (sampled steps) and of the logprobs' graphs."""

    def __init__(self, runner):
        graphs = runner.graph_runner
        self.samplers = [g for by_width in graphs.samplers.values() for g in by_width.values()]
        self.logprobs = [g for g, _ in graphs.logprob_graphs.values()]
        self.start = self.counts()

    def counts(self) -> tuple[int, int]:
        return sum(g.replays for g in self.samplers), sum(g.replays for g in self.logprobs)

    def since(self) -> tuple[int, int]:
        now = self.counts()
        return now[0] - self.start[0], now[1] - self.start[1]


def _prefill(runner, prompts):
    rows = [runner.kv.new_request() for _ in prompts]
    runner.forward(build_batch(runner.kv, rows, [0] * len(prompts), prompts, runner.device))
    return rows


@pytest.mark.parametrize("batch_size", [1, 3, 6, 8])  # 3 and 6 replay the graphs of 4 and 8, padded
def test_a_sampled_step_in_the_graph_equals_the_eager_sampler(runner, batch_size):
    rng = random.Random(batch_size)
    prompts = [[rng.randrange(1, 200) for _ in range(3 + 2 * i)] for i in range(batch_size)]
    steps = [mixed_params(rng, batch_size) for _ in range(3)]  # new parameters every step: a stale row shows
    replays = Replays(runner)
    graph_and_eager_steps(runner, prompts, steps)
    sampled_steps = sum(not all(p.greedy for p in params) for params in steps)
    assert replays.since()[0] == sampled_steps, "sampled steps replay a sampler graph"


def test_greedy_steps_read_the_forwards_argmax_and_copy_no_parameters(runner, monkeypatch):
    copies = []
    graphs = runner.graph_runner
    monkeypatch.setattr(graphs, "sampling", _CopySpy(graphs.sampling, copies))
    replays = Replays(runner)
    rows = _prefill(runner, [[5, 6, 7], [8, 9]])
    try:
        batch = build_batch(runner.kv, rows, [3, 2], [[1], [2]], runner.device)
        logits, out = runner.forward_and_sample(batch, [SamplingParams(temperature=0)] * 2, [0, 0])
        assert torch.equal(out.token_ids, logits.argmax(-1))
        assert out.token_ids.data_ptr() == graphs.tokens.data_ptr(), "the tokens the graph left"
    finally:
        for row in rows:
            runner.kv.release(row)
    assert replays.since() == (0, 0) and copies == []


class _CopySpy:
    """Stands in for the static parameters on the host side: logs each access (a copy into them)."""

    def __init__(self, tensor: torch.Tensor, log: list):
        self.tensor, self.log = tensor, log

    def __getitem__(self, index):
        self.log.append(index)
        return self.tensor[index]


@pytest.mark.parametrize(
    "special",
    [
        dict(repetition_penalty=1.3),
        dict(frequency_penalty=0.5),
        dict(logit_bias={7: 5.0}),
        dict(min_tokens=4),
        dict(logprobs=25),
    ],
    ids=["repetition", "frequency", "bias", "min_tokens", "many_logprobs"],
)
def test_rows_the_graph_does_not_serve_sample_eagerly_after_the_replay(runner, special):
    """One row with what the graph's sampler does not do: the step replays the forward, samples eagerly and gives
    what the eager sampler gives."""
    from omnirun.sampling import TokenHistory

    rng = random.Random(7)
    prompts = [[rng.randrange(1, 200) for _ in range(4)] for _ in range(3)]
    params = mixed_params(rng, 2, logprobs=False) + [SamplingParams(temperature=0.9, seed=5, **special)]
    rows = _prefill(runner, prompts)
    history = TokenHistory(prompt_ids=prompts, output_ids=[[4], [5], [6]])
    replays = Replays(runner)
    try:
        batch = build_batch(runner.kv, rows, [4, 4, 4], [[1], [2], [3]], runner.device)
        assert runner.graph_runner.can_run(batch)
        torch.manual_seed(0)
        logits, out = runner.forward_and_sample(batch, params, [1, 1, 1], history)
        torch.manual_seed(0)
        assert_same_output(out, runner.sample(logits.clone(), params, [1, 1, 1], history))
    finally:
        for row in rows:
            runner.kv.release(row)
    assert replays.since() == (0, 0), "no sampler graph ran"


def test_a_min_tokens_row_past_its_minimum_samples_in_the_graph(runner):
    params = [SamplingParams(temperature=0.8, min_tokens=2, seed=3), SamplingParams(temperature=0.5, seed=4)]
    replays = Replays(runner)
    graph_and_eager_steps(runner, [[1, 2, 3], [4, 5]], [params], token_index=2)
    assert replays.since() == (1, 0)


def _generate(engine: Engine, prompts, params) -> list[list[int]]:
    requests = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    while engine.has_work:
        engine.step()
    return [list(r.output_ids) for r in requests]


@pytest.mark.parametrize("overlap", [False, True])
def test_a_seeded_request_draws_the_same_tokens_alone_and_in_batches_replayed_and_eager(runner, overlap):
    """Through the engine: a seeded request alone and inside random batches (its row moves), with the sampler in
    the graph and (the graphs switched off) eagerly."""
    seeded = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, min_p=0.01, seed=1234, max_new_tokens=6)
    prompt = [11, 12, 13, 14]
    rng = random.Random(0)

    def others(n):
        params = mixed_params(rng, n, logprobs=False)
        for p in params:
            p.max_new_tokens = rng.randint(1, 8)
        return [[rng.randrange(1, 200) for _ in range(rng.randint(2, 9))] for _ in range(n)], params

    engine = Engine(runner, overlap_schedule=overlap)
    replays = Replays(runner)
    alone = _generate(engine, [prompt], [seeded])[0]
    assert replays.since()[0] >= 5, "the decode steps sampled in the graph"
    for n in (2, 6):
        prompts, params = others(n)
        at = rng.randint(0, n)
        out = _generate(engine, prompts[:at] + [prompt] + prompts[at:], params[:at] + [seeded] + params[at:])
        assert out[at] == alone
    graphs, runner.graph_runner = runner.graph_runner, None
    try:
        prompts, params = others(5)
        eager = _generate(Engine(runner, overlap_schedule=overlap), prompts + [prompt], params + [seeded])
    finally:
        runner.graph_runner = graphs
    assert eager[-1] == alone
