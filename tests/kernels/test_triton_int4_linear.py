"""The Triton `int4_linear` kernels against the op's torch reference (omnirun.layers.native_ops.int4_linear),
which dequantizes as a load does: one to three rows, one or two a program (the GEMV's CUDA-core products, K steps
holding several groups, part of one, or ending past K); 5, 16, 20 and 70 rows (the GEMM's dots in 16- and 64-row
tiles, K steps inside one group); K split over programs; the
weight dequantized whole, then a matmul; bf16 and fp16 activations; N and K that leave partial tiles and a partial
last group; zero points over the whole 0..15 range. Within 16-bit rounding of the output. Without a GPU the kernels
run in Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install 'omnirun[cuda]' or '[rocm]')")

from omnirun.kernels.triton import int4_linear as kernels  # noqa: E402
from omnirun.layers import native_ops  # noqa: E402
from omnirun.quantization.int4 import pack_int4_rows  # noqa: E402

pytestmark = pytest.mark.triton
DEVICE = torch.device("cpu")  # replaced per test by tests/kernels/conftest.py (the triton_device fixture)
N, K = 200, 584  # 73 words a row: partial tiles along N and K, and a partial last group of 32 and of 128


def _weight(n: int, k: int, group: int, gen) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random packed 4-bit values, float32 scales (float16 values, as checkpoints store them) and uint8 zero points
    in 0..15, [n, ceil(k / group)] each."""
    groups = -(-k // group)
    q = torch.randint(0, 16, (n, k), generator=gen)
    scale = (torch.rand(n, groups, generator=gen) * 0.02 + 0.002).half().float()
    zero = torch.randint(0, 16, (n, groups), generator=gen).to(torch.uint8)
    return pack_int4_rows(q), scale, zero


def _to(*tensors):
    return tuple(t.to(DEVICE) if t is not None else None for t in tensors)


def _check(m: int, group: int, kernel, dtype=torch.bfloat16, k: int = K, **tiles) -> None:
    gen = torch.Generator().manual_seed(m * 1000 + group)
    packed, scale, zero = _weight(N, k, group, gen)
    x = torch.randn(m, k, generator=gen).to(dtype)
    bias = torch.randn(N, generator=gen).to(dtype)
    got = kernel(*_to(x, packed, scale, zero, bias), group, **tiles).cpu()
    assert got.dtype == dtype
    expected = native_ops.int4_linear(x.float(), packed, scale, zero, bias.float(), group)
    # the output rounded to 16 bits (2^-8 relative for bf16); the kernel multiplies the exact dequantized weight
    torch.testing.assert_close(got.float(), expected, atol=3e-2, rtol=1.6e-2)


@pytest.mark.parametrize(
    ("group", "block_k", "k", "dtype"),
    [
        (32, 1024, K, torch.bfloat16),  # a step of 32 groups, K a partial step
        (128, 1024, K, torch.float16),  # a partial last group
        (128, 64, K, torch.bfloat16),  # two steps a group
        (32, 256, 512, torch.float16),  # K whole steps: no mask along K
    ],
)
def test_gemv_equals_the_reference(group, block_k, k, dtype):
    _check(1, group, kernels.gemv, dtype=dtype, k=k, block_k=block_k)


@pytest.mark.parametrize(
    ("rows", "per_program", "group", "dtype"),
    [
        (2, 2, 128, torch.bfloat16),  # two rows a program
        (3, 2, 32, torch.float16),  # two programs of two a weight tile, the second's other row past x
        (3, 1, 128, torch.bfloat16),  # one row a program
    ],
)
def test_the_gemv_of_a_few_rows_equals_the_reference(rows, per_program, group, dtype):
    """Both rows' products from one unpacking of the words, joined: every row in its place, bias on each."""
    _check(rows, group, kernels.gemv, dtype=dtype, rows=per_program, block_k=256)


def test_the_gemv_launch_by_rows_and_layer(monkeypatch):
    """Up to two rows, one a program; at most two programs a multiprocessor (a 4,096-row layer on an H100) take
    2,048 inputs a step and 8 warps. Three and four rows: two a program."""
    monkeypatch.setattr(kernels, "processors", lambda device: 132)
    assert kernels.gemv_launch(1, 4096, DEVICE) == kernels.gemv_launch(2, 4096, DEVICE) == (1, 16, 2048, 8)
    assert kernels.gemv_launch(1, 6144, DEVICE) == (1, 16, 1024, 4)
    assert kernels.gemv_launch(3, 4096, DEVICE) == kernels.gemv_launch(4, 6144, DEVICE) == (2, 16, 1024, 4)
    monkeypatch.setattr(kernels, "processors", lambda device: 8)  # N 200: 13 programs of 16 rows
    _check(1, 128, kernels.gemv)
    with pytest.raises(ValueError, match="1 or 2 rows a program"):
        _check(3, 128, kernels.gemv, rows=4)


@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("rows", [5, 16, 20])  # 16-row tiles up to 16 rows, then 64
def test_gemm_of_a_few_rows_equals_the_reference(rows, group):
    _check(rows, group, kernels.gemm)


@pytest.mark.parametrize("group", [32, 128])
def test_gemm_equals_the_reference(group):
    _check(70, group, kernels.gemm, block_m=32, block_n=64)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("rows", "split_k"), [(5, 3), (70, 2)])
def test_k_split_over_programs_adds_up_to_the_reference(rows, split_k, dtype):
    """Each split of K writes a float32 partial sum (the bias in the first alone); groups of 64, 16-bit nibble
    conversion for both activation dtypes (bf16: 128 + q, fp16: 1024 + q)."""
    _check(rows, 64, kernels.gemm, dtype=dtype, split_k=split_k)


def test_a_k_step_inside_one_group_and_the_op_s_dispatch():
    """Groups of 128 read 64 inputs a step (one scale per row and step); the op flattens leading dimensions, picks
    the GEMV, the GEMM or the dequantized weight by rows, and serves float32 through the reference."""
    _check(70, 128, kernels.gemm, block_k=64)
    gen = torch.Generator().manual_seed(3)
    packed, scale, zero = _weight(96, 256, 32, gen)
    for rows in (1, 3, 40, kernels.DEQUANTIZE_MIN_ROWS // 2):
        x = torch.randn(2, rows, 256, generator=gen)
        for dtype in (torch.float32, torch.bfloat16):
            got = kernels.int4_linear(*_to(x.to(dtype), packed, scale, zero, None), 32).cpu()
            assert got.shape == (2, rows, 96) and got.dtype == dtype
            expected = native_ops.int4_linear(x.to(dtype).float(), packed, scale, zero, None, 32)
            torch.testing.assert_close(got.float(), expected, atol=3e-2, rtol=1.6e-2)
    with pytest.raises(ValueError, match="groups of 40"):  # no K step of 16 or more lies in a group of 40
        kernels.gemm(*_to(x[0, :3].to(torch.bfloat16), packed, scale, zero, None), 40)
    with pytest.raises(ValueError, match="bf16 or fp16 activations"):
        kernels.gemm(*_to(x[0, :3], packed, scale, zero, None), 32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_dequantized_weight_is_the_reference_s(dtype):
    """Many rows: the weight dequantized by a kernel (the same float32 products, rounded once to x's dtype), then the
    device's matmul; the reference's own result, bit for bit where the rounding is the device's (float32 here, both
    on a GPU; the interpreter truncates its bf16 casts)."""
    gen = torch.Generator().manual_seed(7)
    packed, scale, zero = _weight(N, K, 128, gen)
    x = torch.randn(40, K, generator=gen).to(dtype)
    bias = torch.randn(N, generator=gen).to(dtype)
    got = kernels.dequantized_linear(*_to(x, packed, scale, zero, bias), 128).cpu()
    expected = native_ops.int4_linear(*_to(x, packed, scale, zero, bias), 128).cpu()
    if dtype == torch.float32 or DEVICE.type != "cpu":
        assert torch.equal(got, expected)
    else:
        torch.testing.assert_close(got.float(), expected.float(), atol=3e-2, rtol=1.6e-2)
