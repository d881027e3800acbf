"""What a platform claims is what it builds: `omnirun env` and the runner read the same answers (graph API, fused
ops, attention backends), never a label of their own."""

from __future__ import annotations

import contextlib
import types

import pytest
import torch

from omnirun.assembly import assemble
from omnirun.config import RunnerConfig
from omnirun.devices.cpu.platform import CpuPlatform
from omnirun.env_report import platform_row, to_table
from omnirun.facts import AttentionOffer
from omnirun.graphs import DecodeGraphRunner, GraphAPI
from omnirun.platform import Platform
from omnirun.registry import default_registry
from omnirun.runner import ModelRunner

STUB_API = GraphAPI(
    "stub_graph", new_graph=object, capture=lambda graph, pool=None: contextlib.nullcontext(), new_pool=object
)


class CapturableBackend:
    """Stands in for a backend class whose decode metadata can live in a graph's static buffers."""

    supports_graph = True


def _built_eagerly(context):
    """A factory function (not a backend class) that says its backend cannot be captured."""


_built_eagerly.supports_graph = False


class GraphCpu(CpuPlatform):
    """The host CPU handing over a (stand-in) graph API and a capturable backend of its own (its default)."""

    def graph_api(self) -> GraphAPI:
        return STUB_API

    def attention_offers(self):
        return (
            AttentionOffer("capturable", CapturableBackend),
            AttentionOffer("function", lambda context: None),
            AttentionOffer("eager", _built_eagerly, capturable=False),
        )


def _graph_runner(
    platform: Platform,
    running: int = 8,
    decode: str | None = None,
    attention: str | None = None,
    graph_limit: int | None = None,
) -> DecodeGraphRunner | None:
    """What a runner with these flags builds for decode graphs: its assembly's plan, made by
    `ModelRunner.planned_graph_runner` over a stand-in runner (no model is loaded)."""
    config = RunnerConfig(
        model="stand-in", decode_attention_backend=decode, attention_backend=attention, max_graph_batch_size=graph_limit
    )
    stand_in = types.SimpleNamespace(assembly=assemble(config, platform, torch.float32, running), platform=platform)
    return ModelRunner.planned_graph_runner(stand_in)


class NormCpu(CpuPlatform):
    """The host CPU with one fused op of its own besides its packed linear."""

    def device_fused_ops(self):
        return {**super().device_fused_ops(), "rms_norm": lambda x, weight, eps: x}


@pytest.mark.parametrize("running", [4, 1000])
def test_the_graph_runner_is_built_over_the_platforms_graph_api(running):
    graphs = _graph_runner(GraphCpu(), running)
    assert isinstance(graphs, DecodeGraphRunner) and graphs.api is STUB_API
    assert graphs.max_batch_size == min(running, GraphCpu.max_graph_batch_size)
    assert _graph_runner(CpuPlatform(), running) is None  # no graph API: eager


@pytest.mark.parametrize(("running", "limit"), [(1000, 512), (1000, 1024), (300, 1024), (1000, 8)])
def test_max_graph_batch_size_replaces_the_platforms_limit(running, limit):
    graphs = _graph_runner(GraphCpu(), running, graph_limit=limit)
    assert graphs.max_batch_size == min(running, limit)
    assert graphs.batch_sizes[-1] == min(running, limit)


@pytest.mark.parametrize(
    ("decode", "attention", "built"),
    [
        (None, None, True),  # GraphCpu's default, a capturable class
        ("torch_native", None, False),  # reads lengths on the host: never captured, so no graph memory reserved
        (None, "torch_native", False),  # --attention-backend covers decode too
        ("capturable", "torch_native", True),  # --decode-attention-backend wins for decode
        ("function", None, True),  # a factory without a flag: the built backend is asked again at capture
        ("eager", None, False),  # a factory function carrying its class's flag
    ],
)
def test_no_graph_runner_where_the_decode_backend_cannot_be_captured(decode, attention, built):
    graphs = _graph_runner(GraphCpu(), decode=decode, attention=attention)
    assert (graphs is not None) == built


def test_the_report_shows_graphs_only_where_a_graph_api_is_built():
    assert platform_row(GraphCpu()).graph_capture == "stub_graph"
    assert platform_row(CpuPlatform()).graph_capture is None


def test_the_report_lists_the_fused_ops_and_backends_the_platform_returns():
    for platform in (CpuPlatform(), NormCpu()):
        row = platform_row(platform)
        assert row.fused_ops == sorted(platform.fused_ops())
        assert row.attention_backends == list(platform.attention_backends())
    assert platform_row(NormCpu()).fused_ops == ["linear", "prepare_linear", "rms_norm"]
    table = to_table([platform_row(NormCpu())], "cpu")
    assert "fused ops   linear, prepare_linear, rms_norm" in table


@pytest.mark.parametrize(
    ("name", "key"), [("cuda", "CUDA"), ("rocm", "CUDA"), ("xpu", "XPU"), ("npu", "PrivateUse1"), ("cpu", "CPU")]
)
def test_the_dispatch_key_follows_the_torch_device_type(name, key):
    assert default_registry().get(name).dispatch_key == key


def test_env_reports_the_parts_a_default_run_builds(tmp_path):
    """`omnirun env`'s default run is the assembly a runner with default flags computes (omnirun.assembly), for a
    model in the device's best dtype: the same backends and graph plan, in the same words."""
    from omnirun.testing import make_runner, tiny_hf_model

    tiny_hf_model("llama").save_pretrained(tmp_path)
    platform = CpuPlatform()
    dtype = platform.capabilities.model_dtypes[0]
    flags = {"dtype": str(dtype).removeprefix("torch."), "max_total_tokens": None}
    with contextlib.closing(make_runner(platform, tmp_path, **flags)) as runner:
        assert platform_row(platform).default_run == f"{flags['dtype']}: {runner.assembly.summary()}"
        assert runner.attention_choice == (runner.assembly.prefill_attention, runner.assembly.decode_attention)
    with contextlib.closing(make_runner(platform, tmp_path, deterministic=True, **flags)) as runner:
        row = platform_row(platform)
        assert row.deterministic.startswith(f"attention {runner.assembly.decode_attention}")
        assert row.deterministic.endswith(runner.assembly.deterministic_linear)


def test_the_assembly_says_why_decode_runs_eagerly():
    def why(platform, experts=False, **flags):
        config = RunnerConfig(model="stand-in", **flags)
        return assemble(config, platform, torch.float32, 8, experts=experts).graphs_reason

    assert why(CpuPlatform()) == "cpu has no graph API"
    assert why(GraphCpu(), disable_graph=True) == "--disable-graph"
    assert why(GraphCpu(), decode_attention_backend="eager") == "the eager decode backend cannot be captured"
    assert why(GraphCpu()) == ""  # captured: nothing to explain
    # A mixture of experts without a platform kernel runs the reference, which picks tokens on the host.
    assert why(GraphCpu(), experts=True) == "cpu offers no fused_moe kernel, and the reference syncs with the host"
