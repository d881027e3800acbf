"""The Triton fused ops against their torch-native references (`omnirun.layers.native_ops`).

Without a GPU the kernels run in Triton's interpreter (numpy). Rotary embedding is checked bit for bit in float32
and bfloat16: every step is an IEEE operation on exactly defined values. rmsnorm and silu-and-mul are bit-exact in
bfloat16 except where a float32 intermediate lies within a few float32 ulps of a bfloat16 rounding midpoint: the
reference's own choices (torch's reduction order and mean, its exp) move that intermediate by an ulp or two, and
those elements may differ by one bfloat16 ulp. Float32 results are compared with a 1e-6 tolerance.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install 'omnirun[cuda]' or '[rocm]')")

from omnirun.kernels.triton import token_bitmask as triton_token_bitmask  # noqa: E402
from omnirun.kernels.triton.ops import (  # noqa: E402
    add_rms_norm,
    rms_norm,
    rotary_embedding,
    silu_and_mul,
    triton_fused_ops,
)
from omnirun.kernels.triton.penalties import apply_penalties as triton_apply_penalties  # noqa: E402
from omnirun.kernels.triton.sample import sample as triton_sample  # noqa: E402
from omnirun.layers import native_ops  # noqa: E402
from omnirun.layers.ops import deterministic_ops, resolve_ops  # noqa: E402
from omnirun.layers.rotary import cos_sin_table  # noqa: E402
from omnirun.sampling import adjust as sampling_adjust  # noqa: E402
from omnirun.sampling import reference as sampling_reference  # noqa: E402

pytestmark = pytest.mark.triton
DEVICE = torch.device("cpu")  # replaced per test by tests/kernels/conftest.py (the triton_device fixture)
EPS = 1e-6
# A float32 value this close to a bfloat16 midpoint may round either way once a reduction's order changes.
BOUNDARY_ULPS = 64


def _randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale + shift).to(dtype).to(DEVICE)


def _near_bf16_midpoint(y32: torch.Tensor) -> torch.Tensor:
    """Where the float32 `y32` lies within BOUNDARY_ULPS float32 ulps of a bfloat16 rounding midpoint."""
    low_bits = y32.contiguous().view(torch.int32) & 0xFFFF
    return (low_bits - 0x8000).abs() <= BOUNDARY_ULPS


def _assert_matches(ours: torch.Tensor, ref: torch.Tensor, decided_by: torch.Tensor) -> None:
    """float32: within 1e-6. bfloat16: equal bit for bit wherever `decided_by` (the float32 value the reference
    rounds) is not at a rounding midpoint; within a bfloat16 ulp or two at the few that are."""
    assert ours.dtype == ref.dtype and ours.shape == ref.shape
    if ref.dtype == torch.float32:
        torch.testing.assert_close(ours, ref, atol=1e-6, rtol=1e-6)
        return
    ambiguous = _near_bf16_midpoint(decided_by)
    assert ambiguous.float().mean().item() < 0.01  # the exemption stays tiny, so the check is not vacuous
    assert torch.equal(ours[~ambiguous], ref[~ambiguous])
    torch.testing.assert_close(ours[ambiguous].float(), ref[ambiguous].float(), rtol=2**-6, atol=0.0)


def _normalised(x: torch.Tensor) -> torch.Tensor:
    """The float32 value rms_norm rounds to x's dtype before applying the weight."""
    x32 = x.float()
    return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS)


# Few rows for the interpreter; 37 rows of 64 span two programs of 32 rows (the last one partly masked).
NORM_SHAPES = [(37, 64), (5, 896), (3, 4096)]
DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", NORM_SHAPES)
def test_rms_norm_matches_reference(rows: int, hidden: int, dtype: torch.dtype):
    x = _randn(rows, hidden, dtype=dtype, seed=hidden)
    weight = _randn(hidden, dtype=dtype, seed=hidden + 1, scale=0.1, shift=1.0)
    ours = rms_norm(x, weight, EPS)
    _assert_matches(ours, native_ops.rms_norm(x, weight, EPS), _normalised(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", NORM_SHAPES)
def test_add_rms_norm_matches_reference_and_reuses_the_inputs_memory(rows: int, hidden: int, dtype: torch.dtype):
    x = _randn(rows, hidden, dtype=dtype, seed=hidden + 2)
    residual = _randn(rows, hidden, dtype=dtype, seed=hidden + 3, scale=4.0)
    weight = _randn(hidden, dtype=dtype, seed=hidden + 4, scale=0.1, shift=1.0)
    ref_normed, ref_summed = native_ops.add_rms_norm(x, residual, weight, EPS)
    x_ptr, residual_ptr = x.data_ptr(), residual.data_ptr()

    normed, summed = add_rms_norm(x, residual, weight, EPS)

    assert torch.equal(summed, ref_summed)  # one rounded addition: exact in every dtype
    _assert_matches(normed, ref_normed, _normalised(ref_summed))
    assert normed.data_ptr() == x_ptr and summed.data_ptr() == residual_ptr


def test_rms_norm_reads_row_strided_views_and_any_leading_shape():
    wide = _randn(6, 200, dtype=torch.bfloat16, seed=7)
    weight = _randn(128, dtype=torch.bfloat16, seed=8, scale=0.1, shift=1.0)
    view = wide[:, 8:136]  # rows 200 apart, 128 long
    ours = rms_norm(view, weight, EPS)
    assert ours.is_contiguous()
    _assert_matches(ours, native_ops.rms_norm(view, weight, EPS), _normalised(view))
    batched = view.reshape(2, 3, 128)
    assert torch.equal(rms_norm(batched, weight, EPS), ours.view(2, 3, 128))


def test_add_rms_norm_with_a_float32_weight_promotes_as_the_reference():
    x = _randn(4, 96, dtype=torch.bfloat16, seed=9)
    residual = _randn(4, 96, dtype=torch.bfloat16, seed=10)
    weight = _randn(96, dtype=torch.float32, seed=11, scale=0.1, shift=1.0)
    ref_normed, ref_summed = native_ops.add_rms_norm(x.clone(), residual.clone(), weight, EPS)
    normed, summed = add_rms_norm(x, residual, weight, EPS)
    assert normed.dtype == torch.float32 and torch.equal(summed, ref_summed)
    # The normalised value is rounded to bf16 before the float32 weight: allow that rounding's ambiguity only.
    ambiguous = _near_bf16_midpoint(_normalised(ref_summed))
    assert torch.equal(normed[~ambiguous], ref_normed[~ambiguous])


def test_empty_batches_launch_nothing():
    weight = torch.ones(64, dtype=torch.bfloat16, device=DEVICE)
    empty = torch.empty(0, 64, dtype=torch.bfloat16, device=DEVICE)
    assert rms_norm(empty, weight, EPS).shape == (0, 64)
    assert [t.shape for t in add_rms_norm(empty, empty.clone(), weight, EPS)] == [(0, 64), (0, 64)]
    assert silu_and_mul(empty).shape == (0, 32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,d", [(9, 64), (3, 896), (2, 4096), (1, 5000)])
def test_silu_and_mul_matches_reference(tokens: int, d: int, dtype: torch.dtype):
    # 5000 columns span three 2048-wide tiles, the last one partly masked.
    x = _randn(tokens, 2 * d, dtype=dtype, seed=d, scale=3.0)
    ours = silu_and_mul(x)
    _assert_matches(ours, native_ops.silu_and_mul(x), torch.nn.functional.silu(x[:, :d].float()))


def _cos_sin_cache(head_dim: int, max_positions: int) -> torch.Tensor:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    return cos_sin_table(inv_freq, 1.0, max_positions).to(DEVICE)


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float16])
@pytest.mark.parametrize(
    "tokens,heads,kv_heads,head_dim",
    [(7, 4, 2, 64), (5, 4, 1, 128), (3, 40, 8, 128)],  # the last: q's 40 heads take two chunks of 32
)
def test_rotary_embedding_rotates_fused_qkv_views_in_place_bit_exact(
    tokens: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype
):
    cache = _cos_sin_cache(head_dim, 4097)
    gen = torch.Generator().manual_seed(head_dim + heads)
    positions = torch.randint(0, 4097, (tokens,), generator=gen)
    positions[0] = 4096  # the largest position the table holds
    positions = positions.to(DEVICE)
    qkv = _randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=heads + head_dim)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    assert not q.is_contiguous() and not k.is_contiguous()
    ref_q, ref_k = native_ops.rotary_embedding(positions, q.clone(), k.clone(), cache, head_dim)
    v_before = v.clone()

    out_q, out_k = rotary_embedding(positions, q, k, cache, head_dim)

    assert out_q is q and out_k is k
    assert torch.equal(q, ref_q) and torch.equal(k, ref_k)
    assert torch.equal(v, v_before)


def test_rotary_embedding_keeps_its_in_place_contract_on_the_reference_path():
    # A float64 activation is not one the kernel handles: the reference computes it, written back in place.
    cache = _cos_sin_cache(64, 16)
    positions = torch.tensor([3, 15], device=DEVICE)
    q = _randn(2, 128, dtype=torch.float64, seed=1)
    k = _randn(2, 64, dtype=torch.float64, seed=2)
    ref_q, ref_k = native_ops.rotary_embedding(positions, q.clone(), k.clone(), cache, 64)
    out_q, out_k = rotary_embedding(positions, q, k, cache, 64)
    assert out_q is q and torch.equal(q, ref_q) and torch.equal(k, ref_k)


def test_the_op_table_takes_every_kernel():
    ops = triton_fused_ops()
    assert set(ops) == {
        "rms_norm",
        "add_rms_norm",
        "silu_and_mul",
        "rotary_embedding",
        "batch_invariant_linear",
        "sample",
        "apply_penalties",
        "apply_token_bitmask",
        "fused_moe",
        "int4_fused_moe",
        "int4_linear",
        "int4_linear_takes",
    }
    table = resolve_ops(ops)
    assert table.rms_norm is rms_norm and table.rotary_embedding is rotary_embedding
    assert table.sample is triton_sample is not sampling_reference.sample
    assert table.apply_penalties is triton_apply_penalties is not sampling_adjust.apply_penalties
    assert table.apply_token_bitmask is triton_token_bitmask.apply_token_bitmask
    assert table.linear is native_ops.linear  # what the kernels do not cover stays the reference
    # The batch-invariant matmul serves deterministic mode's linear layers only.
    assert deterministic_ops(table).linear is ops["batch_invariant_linear"] is not native_ops.batch_invariant_linear


def test_importing_the_gpu_platforms_does_not_import_triton():
    script = (
        "import sys, omnirun, omnirun.layers.ops, omnirun.devices.cuda.platform, omnirun.devices.rocm.platform\n"
        "print('triton' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
