"""The recording graph that fake lanes replay decode steps with: it must behave like a device graph."""

from __future__ import annotations

import pytest
import torch

from omnirun.fake_device import RecordingGraph, recording_capture, recording_graph_api


def _step(x: torch.Tensor, w: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    h = torch.relu(x @ w).view(-1)  # an out-of-place op, then a view of its result
    cache.index_copy_(0, slots, x)  # an in-place write into a buffer that outlives the step
    return h + 1


def test_replay_reads_the_static_inputs_and_writes_the_captured_outputs():
    x, w = torch.randn(3, 4), torch.randn(4, 5)
    cache, slots = torch.zeros(8, 4), torch.tensor([5, 1, 2])
    graph = RecordingGraph()
    with recording_capture(graph):
        out = _step(x, w, cache, slots)
    x.copy_(torch.randn(3, 4))
    slots.copy_(torch.tensor([0, 6, 7]))
    cache.zero_()
    graph.replay()
    assert torch.equal(out, torch.relu(x @ w).view(-1) + 1)
    assert torch.equal(cache[[0, 6, 7]], x) and torch.count_nonzero(cache[[1, 2, 3, 4, 5]]) == 0


def test_host_values_are_frozen_at_capture():
    x = torch.arange(6.0)
    lengths = [2, 4]
    graph = RecordingGraph()
    with recording_capture(graph):
        out = x.narrow(0, 0, lengths[0]).sum().reshape(1) + torch.tensor(lengths, dtype=torch.float32)
    lengths[0] = 5  # a real graph keeps what it captured; so does the recording
    x.fill_(1.0)
    graph.replay()
    assert out.tolist() == [4.0, 6.0]


def test_a_host_read_during_capture_fails_as_on_a_device():
    graph = RecordingGraph()
    with pytest.raises(RuntimeError, match="host"), recording_capture(graph):
        torch.ones(2).sum().item()


def test_the_graph_api_refuses_replay_before_capture_and_capture_twice():
    api = recording_graph_api("fake_graph")
    graph = api.new_graph()
    with pytest.raises(RuntimeError, match="not finished"):
        graph.replay()
    with api.capture(graph, pool=api.new_pool()):
        torch.ones(1).add_(1)
    with pytest.raises(RuntimeError, match="reset"):
        graph.capture_begin()
