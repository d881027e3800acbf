"""Programmatic dependent launch on a real GPU: a decode step's chain of Triton kernels gives the same bits with it
as without it. Every kernel reads what the one before wrote and the layers reuse their buffers, so a kernel that
touched memory before its wait would show as a difference. Skipped without a Hopper (or later) GPU."""

from __future__ import annotations

import pytest
import torch

from omnirun.devices.cuda.platform import PDL_MIN_SM

pytestmark = pytest.mark.device("cuda")

if not torch.cuda.is_available() or torch.cuda.get_device_capability() < PDL_MIN_SM:
    pytest.skip("needs an NVIDIA GPU of compute capability 9.0 or later", allow_module_level=True)
triton = pytest.importorskip("triton", reason="the Triton kernels need triton")

from omnirun.devices.cuda import gemv  # noqa: E402
from omnirun.kernels.triton import ops  # noqa: E402
from omnirun.kernels.triton.decode import decode_attention, partial_buffers  # noqa: E402
from omnirun.kernels.triton.kv_store import rotate_and_store_kv  # noqa: E402
from omnirun.layers.rotary import cos_sin_table  # noqa: E402

LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MLP, CONTEXT = 6, 2048, 16, 4, 128, 5632, 300


def _weights() -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape, scale):
        return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(torch.bfloat16)

    qkv = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    return [
        {
            "norm1": 1 + rand(HIDDEN, scale=0.1),
            "norm2": 1 + rand(HIDDEN, scale=0.1),
            "qkv": rand(qkv, HIDDEN, scale=HIDDEN**-0.5),
            "o": rand(HIDDEN, HEADS * HEAD_DIM, scale=HIDDEN**-0.5),
            "gate_up": rand(2 * MLP, HIDDEN, scale=HIDDEN**-0.5),
            "down": rand(HIDDEN, MLP, scale=MLP**-0.5),
        }
        for _ in range(LAYERS)
    ]


def _step(weights, caches, inputs, pdl: bool) -> torch.Tensor:
    """One decode token through every layer, all kernels launched with or without PDL."""
    hidden, positions, slots, table, rows, seq_lens, req_to_token = inputs
    hidden = hidden.clone()  # add_rms_norm writes over its input: keep the graph's input for the next replay
    residual = torch.zeros_like(hidden)
    part_out, part_lse = partial_buffers(1, HEADS, 16, HEAD_DIM, hidden.device)
    q_size, kv_size = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    for w, (k_cache, v_cache) in zip(weights, caches, strict=True):
        hidden, residual = ops.add_rms_norm(hidden, residual, w["norm1"], 1e-6, pdl=pdl)
        q, k, v = gemv.linear(hidden, w["qkv"], None, pdl=pdl).split([q_size, kv_size, kv_size], dim=-1)
        rotate_and_store_kv(k_cache, v_cache, slots, positions, q, k, v, table, HEAD_DIM, pdl=pdl)
        attn = torch.empty(1, HEADS, HEAD_DIM, dtype=hidden.dtype, device=hidden.device)
        decode_attention(
            q.view(1, HEADS, HEAD_DIM), k_cache, v_cache, req_to_token, rows, seq_lens, part_out, part_lse, attn,
            HEAD_DIM**-0.5, pdl=pdl,
        )  # fmt: skip
        hidden = gemv.linear(attn.view(1, -1), w["o"], None, pdl=pdl)
        hidden, residual = ops.add_rms_norm(hidden, residual, w["norm2"], 1e-6, pdl=pdl)
        act = ops.silu_and_mul(gemv.linear(hidden, w["gate_up"], None, pdl=pdl), pdl=pdl)
        hidden = gemv.linear(act, w["down"], None, pdl=pdl)
    return ops.rms_norm(hidden, weights[0]["norm1"], 1e-6, pdl=pdl)


def _replays(pdl: bool, weights, replays: int = 8) -> list[torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(1)
    caches = [
        tuple(torch.randn(CONTEXT, KV_HEADS, HEAD_DIM, generator=gen, device="cuda").to(torch.bfloat16) for _ in "kv")
        for _ in range(LAYERS)
    ]
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
    inputs = (
        torch.randn(1, HIDDEN, generator=gen, device="cuda").to(torch.bfloat16),
        torch.tensor([CONTEXT - 1], device="cuda"),  # the new token's position and slot
        torch.tensor([CONTEXT - 1], device="cuda"),
        cos_sin_table(inv_freq, 1.0, CONTEXT).cuda(),
        torch.zeros(1, dtype=torch.int64, device="cuda"),
        torch.tensor([CONTEXT], dtype=torch.int32, device="cuda"),
        torch.arange(CONTEXT, dtype=torch.int32, device="cuda")[None],
    )
    _step(weights, caches, inputs, pdl)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _step(weights, caches, inputs, pdl)
    outs = []
    for _ in range(replays):
        graph.replay()
        outs.append(out.clone())
    torch.cuda.synchronize()
    return outs


def test_a_decode_chain_in_a_graph_gives_the_same_bits_with_pdl():
    weights = _weights()
    want = _replays(False, weights)
    got = _replays(True, weights)
    assert all(torch.equal(w, want[0]) for w in want)  # the chain itself is deterministic
    for replay, out in enumerate(got):
        assert torch.equal(out, want[0]), f"replay {replay}: {(out != want[0]).sum().item()} values differ"
