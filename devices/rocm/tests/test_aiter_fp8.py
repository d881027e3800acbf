"""rocm's `fp8_linear` and `prepare_fp8_linear` over the fake aiter (fake_aiter_fp8.py): the e4m3fn -> e4m3fnuz
conversion an MI300 needs, each path against the torch reference (omnirun.layers.native_ops.fp8_linear) within the
stated tolerance and against the quantization it is meant to do, and what goes to the reference instead."""

from __future__ import annotations

import pytest
import torch

from omnirun.devices.rocm.aiter_fp8 import WEIGHT_ONLY_MAX_ROWS, AiterFp8Weight, aiter_fp8_ops
from omnirun.devices.rocm.fnuz import e4m3fn_as_fnuz
from omnirun.layers import native_ops

GPUS = [("gfx942", torch.float8_e4m3fnuz), ("gfx950", torch.float8_e4m3fn)]
E4M3_MAX = 448.0
# Activations quantized to e4m3 (3 mantissa bits) move a product by about 2^-4 / sqrt(3) of each element, averaged
# over K: relative to the output's norm ~2.5 % here. 5 % leaves room (the Triton W8A8 kernel's test states the same);
# a scale off by two, a block read from the wrong row or a lost bias is far past it.
W8A8_TOLERANCE = 0.05
SCHEMES = {"per-channel": None, "per-tensor": None, "block 128x128": (128, 128)}


def _weight(scheme: str, n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A checkpoint's fp8 weight [n, k] and its scales: one per row, one per tensor repeated per row (as the layers
    keep it), or one per 128 x 128 block."""
    w = (torch.randn(n, k, generator=gen) * 40).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    if scheme == "per-channel":
        return w, torch.rand(n, generator=gen) * 1e-2 + 1e-3
    if scheme == "per-tensor":
        return w, torch.full((n,), 4e-3)
    return w, torch.rand(-(-n // 128), -(-k // 128), generator=gen) * 1e-2 + 1e-3


def _ops(aiter, triton=False):
    return aiter_fp8_ops(aiter, aiter.dtypes.fp8, triton=triton)


def _quantized_activations(x: torch.Tensor, group: int, fp8: torch.dtype) -> torch.Tensor:
    """x as the W8A8 GEMM sees it (the test's own reading): each row's groups of `group` columns scaled by amax /
    the fp8 maximum (448 for e4m3fn, 240 for e4m3fnuz), rounded to `fp8` and back, in float32."""
    top = torch.finfo(fp8).max
    parts = x.float().reshape(x.shape[0], -1, group)
    scale = parts.abs().amax(-1, keepdim=True) / top
    return ((parts / scale).clamp(-top, top).to(fp8).float() * scale).reshape(x.shape)


def _relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.float() - expected.float()).norm() / expected.float().norm())


# --- the fnuz flavour ---
def test_every_e4m3fn_value_reads_the_same_as_fnuz_with_the_scale_doubled():
    bits = torch.arange(256, dtype=torch.uint8)
    finite = (bits & 0x7F) != 0x7F  # e4m3fn's two NaNs: no checkpoint holds them
    weight = bits.view(torch.float8_e4m3fn).reshape(16, 16)
    scale = torch.rand(16, 1) + 0.5
    fnuz, doubled = e4m3fn_as_fnuz(weight, scale)
    assert fnuz.dtype == torch.float8_e4m3fnuz and torch.equal(doubled, scale * 2)
    expected = (weight.float() * scale).flatten()[finite]
    assert torch.equal((fnuz.float() * doubled).flatten()[finite], expected)  # exactly: a power of two
    # 0x80, e4m3fn's negative zero, is fnuz's NaN: it becomes 0x00.
    assert fnuz.view(torch.uint8).flatten()[0x80] == 0 and not fnuz.float().isnan().any()
    assert weight.view(torch.uint8).flatten()[0x80] == 0x80  # the loaded tensor is left as it was
    with pytest.raises(TypeError, match="float8_e4m3fn weight"):
        e4m3fn_as_fnuz(fnuz, scale)


@pytest.mark.parametrize(("gfx", "fp8"), GPUS)
def test_prepare_makes_the_gpus_encoding_and_the_gemms_scale_layout(use_aiter, gfx, fp8):
    prepare = _ops(use_aiter(gfx))["prepare_fp8_linear"]
    gen = torch.Generator().manual_seed(0)
    weight, scale = _weight("per-channel", 32, 256, gen)
    weight.view(torch.uint8)[0, :4] = 0x80  # negative zeros
    rows = prepare(weight, scale, None)
    assert isinstance(rows, AiterFp8Weight) and rows.weight.dtype == fp8 and rows.scale.shape == (32, 1)
    blocks = prepare(weight, scale[:2].reshape(1, 2), (128, 128))
    assert blocks.scale.shape == (1, 2)
    if fp8 == torch.float8_e4m3fnuz:  # a new weight in fnuz, scales doubled, negative zero a zero
        assert rows.weight.data_ptr() != weight.data_ptr()
        assert torch.equal(rows.scale.flatten(), scale * 2) and torch.equal(blocks.scale.flatten(), scale[:2] * 2)
        assert not rows.weight.float().isnan().any()
    else:  # gfx950 computes in e4m3fn: the loaded tensors as they are, no copy
        assert rows.weight.data_ptr() == weight.data_ptr() and torch.equal(rows.scale.flatten(), scale)
    assert torch.equal(rows.weight.float() * rows.scale, weight.float() * scale[:, None])


# --- the op against the reference ---
@pytest.mark.parametrize("rows", [WEIGHT_ONLY_MAX_ROWS + 1, 57])
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(("gfx", "fp8"), GPUS)
def test_w8a8_gemms_match_the_reference(use_aiter, gfx, fp8, dtype, scheme, rows):
    aiter = use_aiter(gfx)
    ops = _ops(aiter)
    gen = torch.Generator().manual_seed(rows)
    weight, scale = _weight(scheme, 256, 384, gen)
    block = SCHEMES[scheme]
    x = torch.randn(1, rows, 384, generator=gen).to(dtype)  # a leading dimension, as the layers may pass
    bias = torch.randn(256, generator=gen).to(dtype) if scheme != "per-tensor" else None
    prepared = ops["prepare_fp8_linear"](weight, scale, block)
    got = ops["fp8_linear"](x, weight, scale, bias, block, prepared)
    expected = native_ops.fp8_linear(x, weight, scale, bias, block)
    assert got.shape == (1, rows, 256) and got.dtype == dtype
    assert _relative_error(got, expected) < W8A8_TOLERANCE
    # Exactly what the quantization does: x per token (per 128 columns for blocks) in the GPU's fp8, times the
    # weight dequantized as at load, to the output dtype's rounding (the bias added to the rounded product).
    quantized = _quantized_activations(x[0], 384 if block is None else 128, fp8)
    product = quantized @ native_ops.dequantize_fp8(weight, scale, block).t()
    if bias is not None:
        product = product.to(dtype).float() + bias.float()
    torch.testing.assert_close(got[0].float(), product.to(dtype).float(), atol=2e-2, rtol=1e-2)
    gemm, quant = (
        ("gemm_a8w8_CK", "per_token_quant_hip") if block is None else ("gemm_a8w8_blockscale", "per_group_quant_hip")
    )
    assert aiter.calls == {gemm: 1, quant: 1}


@pytest.mark.parametrize(("gfx", "fp8"), GPUS)
def test_the_op_prepares_what_it_is_not_handed(use_aiter, gfx, fp8):
    """A caller without the prepared form (the conformance suite's) gets the same result: it is made on the way."""
    ops = _ops(use_aiter(gfx))
    gen = torch.Generator().manual_seed(5)
    weight, scale = _weight("block 128x128", 128, 256, gen)
    x = torch.randn(20, 256, generator=gen).to(torch.bfloat16)
    prepared = ops["prepare_fp8_linear"](weight, scale, (128, 128))
    assert torch.equal(
        ops["fp8_linear"](x, weight, scale, None, (128, 128)),
        ops["fp8_linear"](x, weight, scale, None, (128, 128), prepared),
    )


def test_decode_rows_stay_unquantized_on_the_reference_without_triton(aiter):
    ops = _ops(aiter)
    gen = torch.Generator().manual_seed(2)
    for scheme, block in SCHEMES.items():
        weight, scale = _weight(scheme, 256, 384, gen)
        prepared = ops["prepare_fp8_linear"](weight, scale, block)
        for rows in (1, 5, WEIGHT_ONLY_MAX_ROWS):
            x = torch.randn(rows, 384, generator=gen).to(torch.bfloat16)
            got = ops["fp8_linear"](x, weight, scale, None, block, prepared)
            assert torch.equal(got, native_ops.fp8_linear(x, weight, scale, None, block))
    assert not aiter.calls


@pytest.mark.triton
@pytest.mark.parametrize("block", [None, (128, 128)])
@pytest.mark.parametrize(("gfx", "fp8"), GPUS)
def test_decode_rows_run_the_triton_weight_only_kernel_on_the_prepared_weight(
    use_aiter, triton_device, gfx, fp8, block
):
    """Where the platform runs Triton, a decode step's few rows go to the portable weight-only kernel, reading the
    weight in the GPU's encoding (fnuz on an MI300): the reference's values, no activation quantization."""
    aiter = use_aiter(gfx)
    ops = _ops(aiter, triton=True)
    gen = torch.Generator().manual_seed(3)
    weight, scale = _weight("per-channel" if block is None else "block 128x128", 96, 256, gen)
    weight.view(torch.uint8)[:, :8] = 0x80  # negative zeros: NaN if read as fnuz unconverted
    # Outputs of a few units, so that bf16's rounding of them stays below the tolerance.
    weight, scale = weight.to(triton_device), (scale / 8).to(triton_device)
    prepared = ops["prepare_fp8_linear"](weight, scale, block)
    for rows in (1, 3):
        x = torch.randn(rows, 256, generator=gen).to(triton_device, torch.bfloat16)
        bias = torch.randn(96, generator=gen).to(triton_device, torch.bfloat16)
        got = ops["fp8_linear"](x, weight, scale, bias, block, prepared)
        expected = native_ops.fp8_linear(x, weight, scale, bias, block)
        torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=1e-2)
    assert not aiter.calls


def test_what_aiter_does_not_take_goes_to_the_reference(aiter):
    ops = _ops(aiter)
    gen = torch.Generator().manual_seed(4)
    cases = [
        ("per-channel", None, 256, 384, torch.float32),  # a float32 model: aiter writes bf16/fp16 only
        ("per-channel", None, 250, 384, torch.bfloat16),  # N not a multiple of 16
        ("per-channel", None, 256, 200, torch.bfloat16),  # K not a multiple of 16
        ("block", (64, 64), 256, 384, torch.bfloat16),  # blocks other than 128 x 128
        ("block", (128, 128), 256, 320, torch.bfloat16),  # K cut into a partial last group
        ("block", (128, 128), 200, 384, torch.bfloat16),  # N cut into a partial last block
    ]
    for scheme, block, n, k, dtype in cases:
        weight, _ = _weight("per-channel", n, k, gen)
        scale = (
            torch.rand(n, generator=gen) * 1e-2
            if block is None
            else torch.rand(-(-n // block[0]), -(-k // block[1]), generator=gen) * 1e-2
        )
        x = torch.randn(40, k, generator=gen).to(dtype)
        prepared = ops["prepare_fp8_linear"](weight, scale, block)
        got = ops["fp8_linear"](x, weight, scale, None, block, prepared)
        assert torch.equal(got, native_ops.fp8_linear(x, weight, scale, None, block)), (scheme, block, n, k, dtype)
    assert not aiter.calls


def test_layers_keep_fp8_only_where_every_call_has_a_kernel(aiter):
    """`fp8_linear_takes`: decode rows need the Triton weight-only kernel and longer ones an aiter GEMM; a layer
    missing either (no Triton, odd shapes, other blocks, float32) is dequantized at load instead of running the
    reference, which dequantizes at every call."""
    with_triton, without = _ops(aiter, triton=True)["fp8_linear_takes"], _ops(aiter)["fp8_linear_takes"]
    bf16 = torch.bfloat16
    assert with_triton(256, 128, None, bf16) and with_triton(256, 256, (128, 128), torch.float16)
    assert not without(256, 128, None, bf16)  # decode rows would run the reference
    assert not with_triton(200, 128, None, bf16)  # N not a multiple of 16: no row-wise GEMM
    assert not with_triton(256, 200, (128, 128), bf16)  # a partial block: no block-scale GEMM
    assert not with_triton(256, 256, (64, 64), bf16) and not with_triton(256, 128, None, torch.float32)


def test_no_op_where_aiter_lacks_the_gemms_or_computes_in_another_fp8(use_aiter):
    aiter = use_aiter("gfx942")
    assert set(_ops(aiter)) == {"fp8_linear", "prepare_fp8_linear", "fp8_linear_takes"}
    assert aiter_fp8_ops(aiter, torch.float8_e4m3fn, triton=False) == {}  # capabilities and aiter disagree
    del aiter.gemm_a8w8_blockscale  # an older aiter
    assert _ops(aiter) == {}


# --- the fake refuses what the kernels refuse ---
def test_fake_quantizers_and_gemms_refuse_what_the_kernels_refuse(aiter):
    from fake_aiter import AiterCheckError

    per_token = aiter.get_hip_quant(aiter.QuantType.per_Token)
    per_group = aiter.get_hip_quant(aiter.QuantType.per_1x128)
    x = torch.randn(20, 256).to(torch.bfloat16)
    q, s = per_token(x, quant_dtype=torch.float8_e4m3fnuz)
    assert q.dtype == torch.float8_e4m3fnuz and s.shape == (20, 1) and s.dtype == torch.float32
    qg, sg = per_group(x, quant_dtype=torch.float8_e4m3fnuz)
    assert sg.shape == (20, 2)
    w = torch.randn(64, 256).to(torch.float8_e4m3fnuz)
    ws, wb = torch.rand(64, 1), torch.rand(1, 2)
    assert aiter.gemm_a8w8_CK(q, w, s, ws, None, torch.bfloat16).shape == (20, 64)
    assert aiter.gemm_a8w8_blockscale(qg, w, sg, wb, dtype=torch.float16).dtype == torch.float16
    refused = [
        lambda: per_token(x.t(), quant_dtype=torch.float8_e4m3fnuz),  # not contiguous
        lambda: per_token(x, quant_dtype=torch.float8_e4m3fn),  # OCP fp8 on an MI300
        lambda: per_group(x[:, :200].contiguous(), quant_dtype=torch.float8_e4m3fnuz),  # K not grouped by 128
        lambda: aiter.gemm_a8w8_CK(q.view(torch.uint8).view(torch.float8_e4m3fn), w.view(torch.float8_e4m3fn), s, ws),
        lambda: aiter.gemm_a8w8_CK(q, w, s, ws.double()),  # scales of two dtypes
        lambda: aiter.gemm_a8w8_CK(q, w, s[:10], ws),  # one scale per row of x
        lambda: aiter.gemm_a8w8_CK(q, w.t().contiguous().t(), s, ws),  # a column-major weight
        lambda: aiter.gemm_a8w8_CK(q, w, s, ws, torch.zeros(64)),  # a float32 bias for a bf16 output
        lambda: aiter.gemm_a8w8_CK(q, w, s, ws, None, torch.float32),
        lambda: aiter.gemm_a8w8_CK(q[:, :200], w[:, :200], s, ws),  # K = 200: no CK instance
        lambda: aiter.gemm_a8w8_blockscale(qg, w, sg.t().contiguous(), wb),  # scales transposed
        lambda: aiter.gemm_a8w8_blockscale(qg, w, sg, wb.t()),
        lambda: aiter.gemm_a8w8_blockscale(qg, w, sg, wb, isBpreshuffled=True),
    ]
    for i, call in enumerate(refused):
        with pytest.raises(AiterCheckError):
            call()
            pytest.fail(f"the fake accepted case {i}")
    with pytest.raises(AssertionError, match="not supported in gemm_a8w8"):
        aiter.gemm_a8w8_blockscale(qg, w, sg, wb, dtype=torch.float32)
