"""The recording graph that fake lanes replay decode steps with: it must behave like a device graph."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from omnirun_fakes.device import RecordingGraph, recording_capture, recording_graph_api
from omnirun_fakes.lane import fake_lane_environment, without_fake_lane


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


def test_a_cast_replays_into_the_captured_output():
    """`to(dtype)` may alias (no cast needed) or return new memory (a cast): a cast's output must be rewritten,
    else a bf16 model's replays read the capture's values (a float32-only test never sees it)."""
    x, w = torch.randn(2, 8).bfloat16(), torch.randn(8).bfloat16()
    graph = RecordingGraph()
    with torch.inference_mode():
        with recording_capture(graph):
            out = (x.float() * 2).to(x.dtype) * w.to(x.dtype)
        x.copy_(torch.randn(2, 8))
        graph.replay()
    assert torch.equal(out, (x.float() * 2).to(x.dtype) * w)


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


def test_a_fake_lane_reaches_child_processes_and_only_through_its_environment(tmp_path):
    # Ranks, servers and CLIs a test starts are new processes: the registry there must install the lane's fake too,
    # and a child given without_fake_lane() must see the real platform.
    lane = tmp_path / "lane" / "fake_cpu_lane.py"
    lane.parent.mkdir()
    lane.write_text(
        "from omnirun.devices.cpu.platform import CpuPlatform\n"
        "class FakeCpu(CpuPlatform):\n"
        "    pass\n"
        "def install(registry):\n"
        "    registry.register(FakeCpu())\n"
    )
    code = "from omnirun.registry import get_platform\nprint(type(get_platform('cpu')).__name__)"

    def platform_in_child(env):
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)

    env = fake_lane_environment(lane, tmp_path / "scratch")
    assert platform_in_child(env).stdout.strip() == "FakeCpu"
    assert platform_in_child(without_fake_lane(env)).stdout.strip() == "CpuPlatform"
    with pytest.raises(FileNotFoundError, match="fake_lane.py"):
        fake_lane_environment(tmp_path / "missing.py", tmp_path / "scratch")
