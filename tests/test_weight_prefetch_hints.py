"""Where the decoder gives its prefetch hints: each layer, once its q/k/v projection is queued and before its output
projection, names the output projection's and then the MLP's first weight with the batch's token count; the
forward pass joins the prefetches once, after the last layer."""

from __future__ import annotations

import dataclasses

import pytest

from omnirun.batch import build_batch
from omnirun.devices.cpu.platform import CpuPlatform
from omnirun.testing import make_runner


@pytest.mark.parametrize("tokens_per_request", [5, 1])
def test_each_layer_hints_its_next_weights_between_its_qkv_and_output_projections(tiny_checkpoints, tokens_per_request):
    runner = make_runner(CpuPlatform(), tiny_checkpoints["llama"].plain)
    try:
        events = []
        ops = runner.model.model.layers[0].self_attn.ops

        def linear(x, weight, bias, prepared=None):
            events.append(("linear", weight.data_ptr()))
            return ops.linear(x, weight, bias, prepared)

        hinting = dataclasses.replace(
            ops,
            linear=linear,
            prefetch_weights=lambda weights, n: events.append(("prefetch", [w.data_ptr() for w in weights], n)),
            join_prefetches=lambda: events.append(("join",)),
        )
        for module in runner.model.modules():
            if hasattr(module, "ops"):
                module.ops = hinting
        rows = [runner.kv.new_request() for _ in range(2)]
        prompts = [[3, 4, 5, 6, 7], [8, 9, 10, 11, 12]]
        if tokens_per_request == 1:  # a decode step after the prompts
            runner.forward(build_batch(runner.kv, rows, [0, 0], prompts, runner.device))
            events.clear()
            batch = build_batch(runner.kv, rows, [5, 5], [[1], [2]], runner.device)
        else:
            batch = build_batch(runner.kv, rows, [0, 0], prompts, runner.device)
        runner.forward(batch)

        want = []
        for layer in runner.model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            after_qkv = [attn.o_proj.weight.data_ptr(), mlp.gate_up_proj.weight.data_ptr()]
            want += [
                ("linear", attn.qkv_proj.weight.data_ptr()),
                ("prefetch", after_qkv, 2 * tokens_per_request),
                ("linear", attn.o_proj.weight.data_ptr()),
                ("linear", mlp.gate_up_proj.weight.data_ptr()),
                ("linear", mlp.down_proj.weight.data_ptr()),
            ]
        want.append(("join",))
        lm_head = [("linear", runner.model.lm_head.weight.data_ptr())]
        assert events in (want, want + lm_head)
    finally:
        runner.close()
