"""Every linear path adds its bias: the torch-native reference, the Linear layer, the CPU's packed bf16 matmul and
the one-row Triton GEMV (in Triton's interpreter without a GPU). The expected value is a float64 x @ W.T + b."""

from __future__ import annotations

import pytest
import torch

from omnirun.devices.cpu import packed_linear
from omnirun.layers import native_ops
from omnirun.layers.linear import Linear
from omnirun.layers.ops import Ops


def _operands(rows: int, dtype: torch.dtype, device: str = "cpu"):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 64, generator=gen).to(dtype)
    w = (torch.randn(48, 64, generator=gen) / 8).to(dtype)
    b = (torch.randn(48, generator=gen) + 3).to(dtype)  # large next to x @ W.T, so a lost bias cannot hide
    expected = (x.double() @ w.double().T + b.double()).float()
    return x.to(device), w.to(device), b.to(device), expected


def test_reference_linear_adds_the_bias():
    x, w, b, expected = _operands(5, torch.float32)
    torch.testing.assert_close(native_ops.linear(x, w, b), expected)
    torch.testing.assert_close(native_ops.linear(x, w, None), expected - b)


def test_linear_layer_passes_its_bias_and_shards_to_the_op():
    x, w, b, expected = _operands(3, torch.float32)
    layer = Linear(64, {"a": 16, "b": 32}, bias=True, ops=Ops(), dtype=torch.float32)
    layer.weight.data.copy_(w)
    layer.bias.data.copy_(b)
    torch.testing.assert_close(layer(x), expected)
    assert torch.equal(layer.shard_view("bias", "b"), b[16:])
    assert torch.equal(layer.shard_view("weight", "a"), w[:16])


@pytest.mark.skipif(not packed_linear.packing_supported(), reason="oneDNN bf16 packing unsupported on this CPU")
@pytest.mark.parametrize("rows", [1, 7])
def test_cpu_packed_bf16_linear_adds_the_bias(rows):
    x, w, b, expected = _operands(rows, torch.bfloat16)
    prepared = packed_linear.prepare_linear(w)
    assert prepared is not None, "bf16 weights on a CPU with bf16 support are packed"
    out = packed_linear.linear(x.view(1, rows, 64), w, b, prepared)  # a [batch, tokens, hidden] input
    assert out.shape == (1, rows, 48) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out[0].float(), expected, rtol=2e-2, atol=2e-2)
    # the unpacked fallback (weight changed since packing) adds it too
    w.add_(0)
    torch.testing.assert_close(packed_linear.linear(x, w, b, prepared).float(), expected, rtol=2e-2, atol=2e-2)


@pytest.mark.triton
def test_triton_gemv_linear_adds_the_bias(triton_device):
    from omnirun.devices.cuda import gemv as triton_gemv

    x, w, b, expected = _operands(1, torch.bfloat16, triton_device)
    out = triton_gemv.linear(x, w, b)  # one row of bf16: the GEMV's path
    torch.testing.assert_close(out.float().cpu(), expected, rtol=2e-2, atol=2e-2)
