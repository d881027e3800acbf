"""The one-launch KV store (omnirun.kernels.triton.kv_store) against `PagedKVCache.set_kv`, the torch path it replaces.

Stores must agree bit for bit, every slot of the cache included (the slots not written must be left alone). Without
a GPU the kernel runs in the Triton interpreter on CPU tensors.
"""

from __future__ import annotations

import types

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not installed: the Triton KV store needs it")

from omnirun.attention.backend import AttentionContext, AttentionLayerSpec  # noqa: E402
from omnirun.attention.torch_native import TorchNativeAttention  # noqa: E402
from omnirun.kernels.triton.attention_backend import TritonAttention  # noqa: E402
from omnirun.kernels.triton.kv_store import fuses_rotary, rotate_and_store_kv, store_kv, supports  # noqa: E402
from omnirun.layers import native_ops  # noqa: E402
from omnirun.layers.rotary import cos_sin_table  # noqa: E402
from omnirun.memory import KVMemory, PageAllocator, PagedKVCache, ReqToTokenPool  # noqa: E402

pytestmark = pytest.mark.triton
DEVICE = torch.device("cpu")  # replaced per test by tests/kernels/conftest.py (the triton_device fixture)
FP8 = [dt for dt in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None)) if dt is not None]
CACHE_DTYPES = [torch.bfloat16, torch.float16, torch.float32, *FP8]
INPUT_DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# (kv_heads, head_dim): Qwen2-0.5B-like, Llama-3-8B, phi's 80, 96; 36 x 128 needs two chunks per row.
SHAPES = [(1, 64), (8, 128), (2, 80), (4, 96), (36, 128)]
# Finite values every fp8 flavour holds (|x| <= 448), from its subnormals up, with both signs.
IN_RANGE = 400.0


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _values(n: int, width: int, generator: torch.Generator) -> torch.Tensor:
    """float32 [n, width] spread over magnitudes 2^-12 .. 2^8: fp8 subnormals, normals, rounding ties."""
    mant = torch.randn(n, width, generator=generator)
    scale = torch.exp2(torch.randint(-12, 9, (n, width), generator=generator).float())
    return (mant * scale).clamp(-IN_RANGE, IN_RANGE)


def _fused_qkv(n: int, width: int, dtype: torch.dtype, generator: torch.Generator):
    """k, v as the model passes them: strided column slices of one [n, q + 2 * width] qkv output."""
    q_width = 3 * width
    qkv = torch.cat([_values(n, q_width, generator), _values(n, width, generator), _values(n, width, generator)], 1)
    qkv = qkv.to(dtype).to(DEVICE)
    k, v = qkv[:, q_width : q_width + width], qkv[:, q_width + width :]
    assert k.stride() == (q_width + 2 * width, 1) and not v.is_contiguous()
    return k, v


def _caches(num_slots: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> tuple[PagedKVCache, PagedKVCache]:
    """Two one-layer caches holding the same (random, finite) contents."""
    ref, mine = (PagedKVCache(1, num_slots, kv_heads, head_dim, dtype, DEVICE) for _ in range(2))
    gen = torch.Generator().manual_seed(0)
    for a, b in zip(ref.k_buffers + ref.v_buffers, mine.k_buffers + mine.v_buffers, strict=True):
        a.copy_(torch.randn(a.shape, generator=gen).to(dtype))
        b.copy_(a)
    return ref, mine


def _assert_same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype.itemsize == 1:
        got, want = got.view(torch.uint8), want.view(torch.uint8)
    assert torch.equal(got, want), f"{(got != want).sum().item()} of {got.numel()} values differ"


def _compare(k: torch.Tensor, v: torch.Tensor, kv_heads: int, head_dim: int, cache_dtype: torch.dtype, seed: int):
    n = k.shape[0]
    num_slots = 3 * n + 5
    ref, mine = _caches(num_slots, kv_heads, head_dim, cache_dtype)
    slots = torch.randperm(num_slots, generator=torch.Generator().manual_seed(seed))[:n].to(DEVICE)
    shape = (n, kv_heads, head_dim)
    ref.set_kv(0, slots, k.reshape(shape), v.reshape(shape))
    store_kv(mine.k_buffers[0], mine.v_buffers[0], slots, k, v)
    _assert_same_bits(mine.k_buffers[0], ref.k_buffers[0])
    _assert_same_bits(mine.v_buffers[0], ref.v_buffers[0])


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"h{s[0]}-d{s[1]}")
@pytest.mark.parametrize("input_dtype", INPUT_DTYPES, ids=_name)
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=_name)
def test_strided_rows_match_set_kv(cache_dtype, input_dtype, shape):
    kv_heads, head_dim = shape
    n = 3 if kv_heads * head_dim > 1024 else 9
    k, v = _fused_qkv(n, kv_heads * head_dim, input_dtype, torch.Generator().manual_seed(kv_heads + head_dim))
    _compare(k, v, kv_heads, head_dim, cache_dtype, seed=head_dim)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, *FP8], ids=_name)
def test_three_dim_and_int32_slots(cache_dtype):
    """[n, kv_heads, head_dim] inputs (contiguous, and heads strided apart) with int32 slots."""
    kv_heads, head_dim, n = 4, 64, 6
    gen = torch.Generator().manual_seed(7)
    k = _values(n, kv_heads * head_dim, gen).to(torch.bfloat16).view(n, kv_heads, head_dim).to(DEVICE)
    v_wide = _values(n, kv_heads * 2 * head_dim, gen).to(torch.bfloat16).view(n, kv_heads, 2 * head_dim).to(DEVICE)
    v = v_wide[:, :, :head_dim]  # not viewable as rows: the wrapper copies it
    ref, mine = _caches(40, kv_heads, head_dim, cache_dtype)
    slots = torch.tensor([33, 1, 17, 5, 39, 20], dtype=torch.int32, device=DEVICE)
    ref.set_kv(0, slots, k, v)
    store_kv(mine.k_buffers[0], mine.v_buffers[0], slots, k, v)
    _assert_same_bits(mine.k_buffers[0], ref.k_buffers[0])
    _assert_same_bits(mine.v_buffers[0], ref.v_buffers[0])


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy, in the interpreter, on inf/NaN arithmetic
@pytest.mark.parametrize("cache_dtype", FP8, ids=_name)
def test_fp8_every_bf16_and_fp16_value_matches_torch(cache_dtype):
    """Every bf16 and fp16 bit pattern within the fp8 range (NaN, signed zeros and subnormals included) casts to
    torch's bits. (Beyond the range, torch versions differ for e4m3fn: see the next test.)"""
    fp8_max = torch.finfo(cache_dtype).max
    patterns = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
    for dtype in (torch.bfloat16, torch.float16):
        x = patterns.view(dtype)
        x = x[~(x.float().abs() > fp8_max)].to(DEVICE)  # keeps NaN
        n = x.numel() // 256
        rows = x[: n * 256].view(n, 256)
        cache = torch.zeros(n, 1, 256, dtype=cache_dtype, device=DEVICE)
        store_kv(cache, torch.empty_like(cache), torch.arange(n, device=DEVICE), rows, rows)
        _assert_same_bits(cache.view(n, 256), rows.to(cache_dtype))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_fp8_beyond_range():
    """Out of range the kernel does what torch 2.13's cast does: e4m3fn saturates finite overflow and inf to +-448
    (older torch made NaN of them), e5m2 overflows to +-inf; NaN stays NaN; ties round to even."""
    if len(FP8) < 2:
        pytest.skip("torch lacks float8_e4m3fn / float8_e5m2")
    inf, nan = float("inf"), float("nan")
    cases = {  # cache dtype: (inputs, want)
        torch.float8_e4m3fn: (
            [464.0, 479.9, 480.0, 1e6, inf, -500.0, -inf, nan],
            [448.0, 448.0, 448.0, 448.0, 448.0, -448.0, -448.0, nan],
        ),
        torch.float8_e5m2: (  # 61440: the tie between 57344 (odd mantissa) and the next power of two, inf
            [59392.0, 61439.0, 61440.0, 1e6, inf, -7e4, -inf, nan],
            [57344.0, 57344.0, inf, inf, inf, -inf, -inf, nan],
        ),
    }
    for cache_dtype, (values, want) in cases.items():
        x = torch.tensor([values], dtype=torch.float32, device=DEVICE)
        cache = torch.zeros(1, 1, x.shape[1], dtype=cache_dtype, device=DEVICE)
        store_kv(cache, torch.empty_like(cache), torch.zeros(1, dtype=torch.int64, device=DEVICE), x, x)
        want = torch.tensor(want, device=DEVICE)
        torch.testing.assert_close(cache.view(-1).float(), want, equal_nan=True, atol=0, rtol=0)


def _context(cache: PagedKVCache) -> AttentionContext:
    kv = KVMemory(PageAllocator(cache.num_slots - 1, 1), ReqToTokenPool(2, 16, DEVICE), cache, 1)
    return AttentionContext(kv, DEVICE, torch.bfloat16, 8, cache.num_kv_heads, cache.head_dim, max_context_len=16)


@pytest.mark.parametrize(
    "cache_dtype", [torch.bfloat16, *FP8, getattr(torch, "float8_e4m3fnuz", torch.bfloat16)], ids=_name
)
def test_triton_backend_store_kv_matches_torch_native(cache_dtype):
    """TritonAttention.store_kv (the kernel; torch's path for dtypes it lacks, fnuz) stores what torch_native does,
    from strided views of a fused qkv output."""
    kv_heads, head_dim, n = 2, 64, 5
    k, v = _fused_qkv(n, kv_heads * head_dim, torch.bfloat16, torch.Generator().manual_seed(3))
    layer = AttentionLayerSpec(0, 8, kv_heads, head_dim, head_dim**-0.5)
    batch = types.SimpleNamespace(out_cache_loc=torch.tensor([7, 2, 11, 4, 9], device=DEVICE))
    ref, mine = _caches(12, kv_heads, head_dim, cache_dtype)
    TorchNativeAttention(_context(ref)).store_kv(k, v, layer, batch)
    TritonAttention(_context(mine)).store_kv(k, v, layer, batch)
    _assert_same_bits(mine.k_buffers[0], ref.k_buffers[0])
    _assert_same_bits(mine.v_buffers[0], ref.v_buffers[0])


def test_supports_and_rejects():
    assert supports(torch.bfloat16, torch.float32) and not supports(torch.int8, torch.bfloat16)
    if hasattr(torch, "float8_e4m3fnuz"):
        assert not supports(torch.float8_e4m3fnuz, torch.bfloat16)
    cache = torch.zeros(4, 2, 8, device=DEVICE)
    k = torch.zeros(2, 16, device=DEVICE)
    slots = torch.tensor([1, 2], device=DEVICE)
    with pytest.raises(ValueError, match="must be"):
        store_kv(cache, cache.clone(), slots, k[:, :8], k[:, :8])
    with pytest.raises(ValueError, match="slots"):
        store_kv(cache, cache.clone(), slots[:1], k, k)
    store_kv(cache, cache.clone(), slots[:0], k[:0], k[:0])  # no tokens: no launch
    assert not cache.any()


def test_graph_replay_stores_new_data(compiled_triton_platform):
    """Captured once, replayed with new K/V and new slots in the same buffers: no host sync, no per-call state."""
    api = compiled_triton_platform.graph_api()
    if api is None:
        pytest.skip(f"{compiled_triton_platform.name} builds no graph API: nothing to capture")
    kv_heads, head_dim, n, cache_dtype = 8, 128, 4, FP8[0] if FP8 else torch.bfloat16
    gen = torch.Generator().manual_seed(11)
    k, v = _fused_qkv(n, kv_heads * head_dim, torch.bfloat16, gen)
    slots = torch.tensor([3, 1, 8, 6], device=DEVICE)
    ref, mine = _caches(10, kv_heads, head_dim, cache_dtype)
    store_kv(mine.k_buffers[0], mine.v_buffers[0], slots, k, v)  # compiles outside the capture
    graph = api.new_graph()
    with api.capture(graph, pool=api.new_pool()):
        store_kv(mine.k_buffers[0], mine.v_buffers[0], slots, k, v)
    shape = (n, kv_heads, head_dim)
    ref.set_kv(0, slots.clone(), k.view(shape), v.view(shape))  # what the eager call stored
    new_k, new_v = _fused_qkv(n, kv_heads * head_dim, torch.bfloat16, gen)
    k.copy_(new_k)
    v.copy_(new_v)
    slots.copy_(torch.tensor([0, 9, 2, 5]))
    graph.replay()
    ref.set_kv(0, slots, k.view(shape), v.view(shape))
    compiled_triton_platform.synchronize()
    _assert_same_bits(mine.k_buffers[0], ref.k_buffers[0])
    _assert_same_bits(mine.v_buffers[0], ref.v_buffers[0])


# (q heads, kv heads, head_dim): Llama-3-8B; Qwen2.5-0.5B's 14/2 at 64; 80 (half 40: masked lanes); 36 heads of 128
# need two programs a token; MHA.
ROPE_SHAPES = [(32, 8, 128), (14, 2, 64), (4, 2, 80), (36, 36, 128), (4, 4, 64)]


def _rope_inputs(n: int, q_heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int):
    """q, k, v as strided views of one qkv output, positions and a float32 cos|sin table of 300 positions. Values
    stay below 448 / sqrt(2): rotated, they stay within e4m3fn's range (torch 2.11 made NaN beyond it, 2.13 448)."""
    gen = torch.Generator().manual_seed(seed)
    widths = [q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
    qkv = torch.cat([_values(n, w, gen) * 0.75 for w in widths], 1).to(dtype).to(DEVICE)
    q, k, v = qkv.split(widths, dim=1)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    table = cos_sin_table(inv_freq, 1.0, 300).to(DEVICE)
    positions = torch.randint(0, 300, (n,), generator=gen).to(DEVICE)
    return q, k, v, positions, table


@pytest.mark.parametrize("shape", ROPE_SHAPES, ids=lambda s: f"q{s[0]}-kv{s[1]}-d{s[2]}")
@pytest.mark.parametrize("input_dtype", INPUT_DTYPES, ids=_name)
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float32, *FP8], ids=_name)
def test_rotate_and_store_is_the_rotary_reference_then_set_kv(cache_dtype, input_dtype, shape):
    """One launch gives the bits of the torch-native rotation followed by the torch store: q rotated in place, the
    rotated k and the plain v in the written slots, every other slot untouched; k itself is left as it was."""
    q_heads, kv_heads, head_dim = shape
    n = 5
    q, k, v, positions, table = _rope_inputs(n, q_heads, kv_heads, head_dim, input_dtype, seed=sum(shape))
    want_q, want_k = native_ops.rotary_embedding(positions, q.clone(), k.clone(), table, head_dim)
    k_before = k.clone()
    ref, mine = _caches(3 * n + 4, kv_heads, head_dim, cache_dtype)
    slots = torch.randperm(3 * n + 4, generator=torch.Generator().manual_seed(n))[:n].to(DEVICE)
    cache_shape = (n, kv_heads, head_dim)
    ref.set_kv(0, slots, want_k.reshape(cache_shape), v.reshape(cache_shape))
    assert fuses_rotary(mine.k_buffers[0], positions, q, k, v, table, head_dim)
    rotate_and_store_kv(mine.k_buffers[0], mine.v_buffers[0], slots, positions, q, k, v, table, head_dim)
    _assert_same_bits(q, want_q.view(q.shape))
    _assert_same_bits(mine.k_buffers[0], ref.k_buffers[0])
    _assert_same_bits(mine.v_buffers[0], ref.v_buffers[0])
    _assert_same_bits(k, k_before)


def test_fuses_rotary_only_what_both_kernels_take():
    q, k, v, positions, table = _rope_inputs(3, 4, 2, 64, torch.bfloat16, seed=5)
    cache = torch.zeros(8, 2, 64, dtype=torch.bfloat16, device=DEVICE)
    assert fuses_rotary(cache, positions, q, k, v, table, 64)
    assert not fuses_rotary(cache, positions[None], q, k, v, table, 64)  # positions must be 1-D
    assert not fuses_rotary(cache.to(torch.int8), positions, q, k, v, table, 64)  # a cache dtype the store lacks
    assert not fuses_rotary(cache, positions, q, k, v.to(torch.float16), table, 64)  # v unlike k
    assert not fuses_rotary(cache, positions, q, k, v.t().contiguous().t(), table, 64)  # v's rows not contiguous
    assert not fuses_rotary(cache, positions, q, k[:, :64], v[:, :64], table, 64)  # k narrower than a cache row
    odd = torch.zeros(8, 2, 63, dtype=torch.bfloat16, device=DEVICE)
    assert not fuses_rotary(odd, positions, q[:, :252], k[:, :126], v[:, :126], table, 63)  # odd head_dim
    if hasattr(torch, "float8_e4m3fnuz"):
        assert not fuses_rotary(cache.to(torch.float8_e4m3fnuz), positions, q, k, v, table, 64)
    with pytest.raises(ValueError, match="fuses_rotary"):
        rotate_and_store_kv(cache, cache.clone(), positions, positions[None], q, k, v, table, 64)


@pytest.mark.parametrize("cache_dtype", FP8, ids=_name)
@pytest.mark.parametrize("scales", [(0.37, 2.5), (1.0 / 3, 1.0)], ids=["0.37-2.5", "third-1"])
def test_scaled_fp8_stores_the_bits_set_kv_stores(cache_dtype, scales):
    """An fp8 cache with a layer's k_scale and v_scale (not powers of two, so the division rounds): both kernels
    store the bits of `set_kv`'s float32 k / k_scale and v / v_scale."""
    kv_heads, head_dim, n = 2, 64, 7
    q, k, v, positions, table = _rope_inputs(n, 4, kv_heads, head_dim, torch.bfloat16, seed=11)
    k, v = k * 0.3, v * 0.3  # / 0.37 stays within e4m3fn's range, rotated too
    want_q, want_k = native_ops.rotary_embedding(positions, q.clone(), k.clone(), table, head_dim)
    slots = torch.randperm(3 * n, generator=torch.Generator().manual_seed(3))[:n].to(DEVICE)
    cache_shape = (n, kv_heads, head_dim)
    for fused in (False, True):
        ref, mine = _caches(3 * n, kv_heads, head_dim, cache_dtype)
        for cache in (ref, mine):
            cache.set_scales([scales[0]], [scales[1]])
        if fused:
            ref.set_kv(0, slots, want_k.reshape(cache_shape), v.reshape(cache_shape))
            k_cache, v_cache = mine.get_kv(0)
            rotate_and_store_kv(k_cache, v_cache, slots, positions, q.clone(), k, v, table, head_dim, scales=scales)
        else:
            ref.set_kv(0, slots, k.reshape(cache_shape), v.reshape(cache_shape))
            store_kv(mine.k_buffers[0], mine.v_buffers[0], slots, k, v, scales=scales)
        _assert_same_bits(mine.k_buffers[0], ref.k_buffers[0])
        _assert_same_bits(mine.v_buffers[0], ref.v_buffers[0])
        expected = (k.reshape(cache_shape).float() / scales[0]).to(cache_dtype).view(torch.uint8)
        if not fused:  # and what set_kv stores is the float32 quotient, cast
            assert torch.equal(ref.k_buffers[0][slots].view(torch.uint8), expected)
