"""xpu's int4_linear and fp8_linear on IPEX (devices/xpu/ipex_int4.py, ipex_fp8.py) against the torch-native
references, on the fake IPEX of the XPU build, and what goes to the fallback.

Tolerance: the conformance suite's for half dtypes (atol 3e-2, rtol 2e-2). The reference rounds the dequantized weight
to x's dtype before its matmul, IPEX's kernels decompress in float32 (the fake: one rounding at the end), so the two
differ by a few roundings of x's dtype; a wrong nibble or scale is off by far more."""

from __future__ import annotations

import pytest
import torch

from omnirun.devices.xpu.ipex_fp8 import IpexFp8, ipex_fp8_ops, offers_fp8
from omnirun.devices.xpu.ipex_int4 import IpexInt4, ipex_int4_ops, offers_int4
from omnirun.layers import native_ops

HALF_TOL = {"atol": 3e-2, "rtol": 2e-2}
N, K = 96, 256


def _int4_weight(group_size: int, n: int = N, k: int = K, seed: int = 0):
    """Random words (every nibble value), scales float16 holds, zero points over 0..15: [N, K / 8], [N, groups] x2."""
    gen = torch.Generator().manual_seed(seed)
    packed = torch.randint(-(2**31), 2**31, (n, k // 8), generator=gen, dtype=torch.int64).to(torch.int32)
    scale = (torch.rand(n, k // group_size, generator=gen) * 0.02 + 0.002).half().float()
    zero = torch.randint(0, 16, (n, k // group_size), generator=gen).to(torch.uint8)
    return packed, scale, zero


def _counting(name: str, seen: list[str]):
    reference = getattr(native_ops, name)

    def op(*args):
        seen.append(name)
        return reference(*args)

    return op


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("group_size", [32, 128])
def test_int4_linear_on_ipex_matches_the_reference(install_ipex, group_size, rows, bias, dtype) -> None:
    ipex = install_ipex("xpu")
    assert offers_int4(ipex)
    ops = ipex_int4_ops(ipex, fallback={})
    packed, scale, zero = _int4_weight(group_size)
    kept = [t.clone() for t in (packed, scale, zero)]
    prepared = ops["prepare_int4_linear"](packed, scale, zero, group_size)
    assert isinstance(prepared, IpexInt4)
    # IPEX repacks in the tensors it is given: the layer's own must stay as loaded.
    assert all(torch.equal(a, b) for a, b in zip((packed, scale, zero), kept, strict=True))
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(rows, K, generator=gen).to(dtype)
    b = torch.randn(N, generator=gen).to(dtype) if bias else None
    got = ops["int4_linear"](x, packed, scale, zero, b, group_size, prepared)
    want = native_ops.int4_linear(x, packed, scale, zero, b, group_size)
    assert got.dtype == dtype and got.shape == (rows, N)
    torch.testing.assert_close(got.float(), want.float(), **HALF_TOL)
    assert ipex.calls["IPEXWeightOnlyQuantizedLinear.forward"] == 1
    # A leading batch dimension is flattened for IPEX and restored.
    got3 = ops["int4_linear"](x.view(1, rows, K), packed, scale, zero, b, group_size, prepared)
    assert got3.shape == (1, rows, N) and torch.equal(got3[0], got)


def test_int4_prepare_refuses_what_ipex_cannot_take(install_ipex) -> None:
    ipex = install_ipex("xpu")
    prepare = ipex_int4_ops(ipex, fallback={})["prepare_int4_linear"]
    assert prepare(*_int4_weight(16), 16) is None  # no XeTLA kernel for groups of 16 in its GEMV
    assert prepare(*_int4_weight(32, k=64), 32) is None  # K not a multiple of XeTLA's 128
    assert prepare(*_int4_weight(32, n=92), 32) is None  # N not whole words of AWQ's packing
    packed, scale, zero = _int4_weight(32)
    assert prepare(packed, scale * 1e-4, zero, 32) is None  # float16 subnormals would lose the scales' precision
    exact_subnormal = torch.full_like(scale, 2.0**-20)  # held exactly by float16: fine
    assert isinstance(prepare(packed, exact_subnormal, zero, 32), IpexInt4)
    assert ipex.calls["IPEXWeightOnlyQuantizedLinear.from_weight"] == 1


def test_int4_linear_takes_the_fallback_where_ipex_does_not_compute(install_ipex) -> None:
    ipex = install_ipex("xpu")
    seen: list[str] = []
    ops = ipex_int4_ops(ipex, fallback={"int4_linear": _counting("int4_linear", seen)})
    packed, scale, zero = _int4_weight(32)
    prepared = ops["prepare_int4_linear"](packed, scale, zero, 32)
    x = torch.randn(3, K)
    want = native_ops.int4_linear(x, packed, scale, zero, None, 32)
    assert torch.equal(ops["int4_linear"](x, packed, scale, zero, None, 32, prepared), want)  # float32 rows
    ops["int4_linear"](x.bfloat16(), packed, scale, zero, None, 32, None)  # nothing prepared (a refused weight)
    assert seen == ["int4_linear", "int4_linear"]
    assert ipex.calls["IPEXWeightOnlyQuantizedLinear.forward"] == 0


def test_fake_int4_linear_refuses_what_ipex_refuses(install_ipex) -> None:
    quantization = install_ipex("xpu").llm.quantization
    linear = quantization.IPEXWeightOnlyQuantizedLinear
    qweight, scales, qzeros = torch.zeros(256, 12, dtype=torch.int32), torch.ones(8, 96), torch.zeros(8, 12).int()
    awq, int4 = quantization.QuantMethod.AWQ_GEMM, quantization.QuantDtype.INT4
    with pytest.raises(RuntimeError, match="reduce-dim must be divisible"):
        linear.from_weight(qweight, scales, qzeros, 256, 96, group_size=48, quant_method=awq, dtype=int4)
    with pytest.raises(RuntimeError, match="AWQ qweight"):
        linear.from_weight(qweight.t(), scales, qzeros, 256, 96, group_size=32, quant_method=awq, dtype=int4)
    with pytest.raises(RuntimeError, match="scale_dtype"):
        linear.from_weight(qweight, scales.bfloat16(), qzeros, 256, 96, group_size=32, quant_method=awq, dtype=int4)
    module = linear.from_weight(qweight, scales, qzeros, 256, 96, group_size=32, quant_method=awq, dtype=int4)
    with pytest.raises(RuntimeError, match="in half"):
        module(torch.randn(2, 256))
    x = torch.randn(2, 256, dtype=torch.bfloat16)
    assert torch.equal(module(x, torch.ones(96, dtype=torch.bfloat16)), module(x))  # its forward drops a bias


# --- fp8 -----------------------------------------------------------------------------------------------------------


def _fp8_weight(per_tensor: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(N, K, generator=gen) * 8).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.full((N,), 4e-3) if per_tensor else torch.rand(N, generator=gen) * 1e-2 + 1e-3
    return weight, scale


@pytest.mark.parametrize(
    "dtype, per_tensor",
    [(torch.bfloat16, True), (torch.float16, True), (torch.bfloat16, False)],
    ids=["bf16-per-tensor", "fp16-per-tensor", "bf16-per-row"],
)
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("rows", [1, 5])
def test_fp8_linear_on_ipex_matches_the_reference(install_ipex, rows, bias, dtype, per_tensor) -> None:
    ipex = install_ipex("xpu")
    assert offers_fp8()
    ops = ipex_fp8_ops(fallback={})
    weight, scale = _fp8_weight(per_tensor)
    prepared = ops["prepare_fp8_linear"](weight, scale, None)
    assert isinstance(prepared, IpexFp8) and (prepared.per_row is None) == per_tensor
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(rows, K, generator=gen).to(dtype)
    b = torch.randn(N, generator=gen).to(dtype) if bias else None
    got = ops["fp8_linear"](x, weight, scale, b, None, prepared)
    want = native_ops.fp8_linear(x, weight, scale, b, None)
    assert got.dtype == dtype and got.shape == (rows, N)
    torch.testing.assert_close(got.float(), want.float(), **HALF_TOL)
    assert ipex.calls["fp8_gemm_w8a16"] == 1


def test_fp8_linear_takes_the_fallback_where_ipex_does_not_compute(install_ipex) -> None:
    ipex = install_ipex("xpu")
    seen: list[str] = []
    ops = ipex_fp8_ops(fallback={"fp8_linear": _counting("fp8_linear", seen)})
    weight, scale = _fp8_weight(per_tensor=False)
    assert ops["prepare_fp8_linear"](weight, torch.rand(1, 2), (128, 128)) is None  # blocks: IPEX scales per tensor
    prepared = ops["prepare_fp8_linear"](weight, scale, None)
    x = torch.randn(2, K)
    ops["fp8_linear"](x, weight, scale, None, None, prepared)  # float32 rows
    ops["fp8_linear"](x.half(), weight, scale, None, None, prepared)  # per-row scales in float16
    ops["fp8_linear"](x.bfloat16(), weight, scale, None, None, None)
    assert seen == ["fp8_linear"] * 3 and ipex.calls["fp8_gemm_w8a16"] == 0


def test_fake_fp8_gemm_refuses_what_ipex_refuses(install_ipex) -> None:
    install_ipex("xpu")
    gemm = torch.ops.torch_ipex.fp8_gemm_w8a16
    weight, _ = _fp8_weight(per_tensor=True)
    x = torch.randn(2, K, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="one scale per weight"):
        gemm(x, weight, True, torch.ones(N), None)
    with pytest.raises(RuntimeError, match="Unsupported data type"):
        gemm(x.float(), weight, True, torch.ones(1), None)
    with pytest.raises(RuntimeError, match="f8_e5m2 or f8_e4m3fn"):
        gemm(x, weight.bfloat16(), True, torch.ones(1), None)
    assert gemm(x, weight.t(), False, None, None).shape == (2, N)  # [K, N] without trans_B


def test_ipex_without_the_functions_offers_neither(monkeypatch: pytest.MonkeyPatch, install_ipex) -> None:
    older = install_ipex("xpu", "2.7.10+xpu")  # before fp8_gemm_w8a16 (v2.8.10+xpu)
    monkeypatch.delattr(torch.ops.torch_ipex, "fp8_gemm_w8a16", raising=False)  # the xpu-fake lane put it there
    assert older.torch_ops == {} and not offers_fp8() and offers_int4(older)
    del older.llm.quantization  # before v2.5.10+xpu
    assert not offers_int4(older)
