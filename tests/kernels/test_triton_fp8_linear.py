"""The Triton `fp8_linear` kernels against the op's torch reference (omnirun.layers.native_ops.fp8_linear) and
against the quantization they are meant to do, written here in torch:

- activations quantized to e4m3 per token (amax / 448, round half to even): bit for bit as torch's cast;
- the weight-only kernel (decode rows): the reference within bf16 rounding, per-row and block scales;
- the W8A8 kernel (many rows): x quantized per token and 128 columns, times the dequantized weight, within
  float32 summation order; and the unquantized reference within the stated activation-quantization tolerance.

Without a GPU the kernels run in Triton's interpreter.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install 'omnirun[cuda]' or '[rocm]')")

from omnirun.kernels.triton import fp8_linear as kernels  # noqa: E402
from omnirun.layers import native_ops  # noqa: E402

pytestmark = pytest.mark.triton
DEVICE = torch.device("cpu")  # replaced per test by tests/kernels/conftest.py (the triton_device fixture)
E4M3_MAX = 448.0
# How far activations quantized to e4m3 (3 mantissa bits) move a product from the unquantized one, relative to its
# norm: about 2^-4 / sqrt(3) per element, averaged over K; 5 % leaves room, a wrong scale or block is far past it.
W8A8_TOLERANCE = 0.05


def _weight(n: int, k: int, block, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """A random fp8 weight [n, k] and its scales (per row, or per block with partial last blocks)."""
    w = torch.randn(n, k, generator=gen) * 0.05
    if block is None:
        scale = w.abs().amax(1) / E4M3_MAX
        return (w / scale[:, None]).to(torch.float8_e4m3fn), scale
    scale = torch.rand(-(-n // block[0]), -(-k // block[1]), generator=gen) * 2e-4 + 5e-5
    per_element = native_ops.dequantize_fp8(torch.ones(n, k), scale, block)
    return (w / per_element).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


def _to(*tensors):
    return tuple(t.to(DEVICE) if t is not None else None for t in tensors)


def _quantized_groups(x: torch.Tensor, group: int) -> torch.Tensor:
    """x as the W8A8 kernel sees it: each row's groups of `group` columns quantized to e4m3 and back (float32)."""
    rows, cols = x.shape
    out = torch.empty(rows, cols)
    for start in range(0, cols, group):
        part = x[:, start : start + group].float()
        scale = part.abs().amax(1, keepdim=True).clamp(min=1e-12) / E4M3_MAX
        out[:, start : start + group] = (part / scale).clamp(-E4M3_MAX, E4M3_MAX).to(
            torch.float8_e4m3fn
        ).float() * scale
    return out


def test_activations_quantize_per_token_as_torch_rounds_them():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(9, 700, generator=gen) * 3
    x[1] = 0.0  # a row of zeros: the scale's floor, no division by zero
    x[2, :5] = torch.tensor([448.0, -1.97, 1.9999, 0.0039, 7.8])  # values whose rounding carries into the exponent
    x[3] *= 1e-4  # subnormal e4m3 values after scaling
    for dtype in (torch.float32, torch.bfloat16):
        q, scale = kernels.quantize(x.to(DEVICE, dtype))
        xf = x.to(dtype).float()
        expected_scale = xf.abs().amax(1, keepdim=True).clamp(min=1e-12) / E4M3_MAX
        expected = (xf / expected_scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        assert torch.equal(scale.cpu(), expected_scale)
        assert torch.equal(q.cpu().view(torch.uint8), expected.view(torch.uint8)), dtype
    # and per group of 128 columns (the W8A8 GEMM's activations), the last group partial
    q, scale = kernels.quantize(x.to(DEVICE, torch.bfloat16), 128)
    for g, start in enumerate(range(0, 700, 128)):
        part = x.to(torch.bfloat16)[:, start : start + 128].float()
        part_scale = part.abs().amax(1).clamp(min=1e-12) / E4M3_MAX
        assert torch.equal(scale.cpu()[:, g], part_scale)
        expected = (part / part_scale[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        assert torch.equal(q.cpu()[:, start : start + 128].view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.parametrize(
    "block",
    [None, (128, 128), (64, 256), (128, 384), (12, 128)],
    ids=["per-row", "block128", "block64x256", "block128x384", "block12x128"],  # 12 rows: a one-row program spans two
)
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_weight_only_kernel_equals_the_reference(block, rows):
    gen = torch.Generator().manual_seed(rows)
    n, k = 200, 640  # partial last blocks along both dimensions
    weight, scale = _weight(n, k, block, gen)
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16)
    got = kernels.weight_only(*_to(x, weight, scale, bias), block).cpu().float()
    expected = native_ops.fp8_linear(x.float(), weight, scale, bias.float(), block)
    torch.testing.assert_close(got, expected, atol=2e-2, rtol=1.6e-2)  # bf16 output rounding


@pytest.mark.parametrize("block", [None, (128, 128)], ids=["per-row", "block128"])
def test_w8a8_kernel_multiplies_per_group_quantized_activations(block):
    gen = torch.Generator().manual_seed(1)
    rows, n, k = 70, 160, 384
    weight, scale = _weight(n, k, block, gen)
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    x[3] *= 50  # rows of very different ranges: a per-tensor activation scale would lose the small ones
    got = kernels.w8a8(*_to(x, weight, scale, None), block, block_m=32, block_n=64).cpu().float()
    dequantized = native_ops.dequantize_fp8(weight, scale, block)
    emulated = _quantized_groups(x, kernels.BLOCK_K) @ dequantized.t()
    torch.testing.assert_close(got, emulated, atol=2e-2, rtol=1.6e-2)
    exact = x.float() @ dequantized.t()
    assert ((got - exact).norm(dim=1) / exact.norm(dim=1)).max() < W8A8_TOLERANCE


def test_the_op_picks_by_rows_and_serves_every_dtype():
    gen = torch.Generator().manual_seed(2)
    weight, scale = _weight(96, 256, (128, 128), gen)
    for rows in (3, 40):
        x = torch.randn(2, rows, 256, generator=gen)  # [batch, tokens, K]: the op flattens the leading dims
        for dtype in (torch.float32, torch.bfloat16):
            got = kernels.fp8_linear(*_to(x.to(dtype), weight, scale, None), (128, 128)).cpu()
            assert got.shape == (2, rows, 96) and got.dtype == dtype
            exact = native_ops.fp8_linear(x, weight, scale, None, (128, 128))
            assert (got.float() - exact).norm() / exact.norm() < W8A8_TOLERANCE


def test_blocks_narrower_than_the_kernels_k_step_take_the_reference():
    gen = torch.Generator().manual_seed(3)
    weight, scale = _weight(64, 128, (64, 64), gen)
    x = torch.randn(2, 128, generator=gen).to(torch.bfloat16)
    with pytest.raises(ValueError, match="multiple of 128"):
        kernels.weight_only(*_to(x, weight, scale, None), (64, 64))
    got = kernels.fp8_linear(*_to(x, weight, scale, None), (64, 64)).cpu()
    assert torch.equal(got, native_ops.fp8_linear(x, weight, scale, None, (64, 64)))
