"""A platform written for contract version 1 still works through the shims of version 2: its backend factories
become offers (their `supports_graph` and `batch_invariant` flags carried over), its dtype-blind default still
decides, and the assembly plans graphs from those answers."""

from __future__ import annotations

import torch

from omnirun.assembly import assemble
from omnirun.config import RunnerConfig
from omnirun.facts import GraphAPI
from omnirun.platform import Capabilities, Platform, ProbeResult

STUB_API = GraphAPI("stub_graph", new_graph=object, capture=None, new_pool=object)  # never captured here


class Capturable:
    supports_graph = True


def _eager_factory(context):
    return None


_eager_factory.supports_graph = False
_eager_factory.batch_invariant = True


class VersionOne(Platform):
    api_version = 1
    name = "v1dev"
    torch_device_type = "cpu"
    distributed_backend = "gloo"

    def _probe(self) -> ProbeResult:
        return ProbeResult.ok(1)

    def _capabilities(self) -> Capabilities:
        return Capabilities("v1 device", (torch.bfloat16, torch.float32), None, None, supports_triton=False)

    def graph_api(self) -> GraphAPI:
        return STUB_API

    def attention_backend_factories(self):
        return {"fast": Capturable, "careful": _eager_factory}

    def default_attention_backend(self, mode):
        return "careful" if mode == "prefill" else "fast"


def test_version_one_factories_become_offers_with_their_flags():
    offers = {offer.name: offer for offer in VersionOne().all_attention_offers()}
    assert list(offers) == ["fast", "careful", "torch_native", "batch_invariant"]
    assert offers["fast"].capturable and not offers["fast"].batch_invariant
    assert not offers["careful"].capturable and offers["careful"].batch_invariant
    assert offers["fast"].build is Capturable and not offers["fast"].on_request


def test_version_one_defaults_and_the_assembly_built_from_them():
    platform = VersionOne()
    assert platform.default_attention_backend_for("prefill", torch.float32) == "careful"  # its override decides
    plan = assemble(RunnerConfig(model="-"), platform, torch.bfloat16, 8)
    assert (plan.prefill_attention, plan.decode_attention) == ("careful", "fast")
    assert plan.graphs == "stub_graph" and plan.graph_max_batch_size == 8
    eager = assemble(RunnerConfig(model="-", decode_attention_backend="careful"), platform, torch.bfloat16, 8)
    assert eager.graphs is None and eager.graphs_reason == "the careful decode backend cannot be captured"
    deterministic = assemble(RunnerConfig(model="-", deterministic=True), platform, torch.bfloat16, 8)
    assert (deterministic.prefill_attention, deterministic.decode_attention) == ("careful", "careful")
