"""The Triton attention backend against torch_native (the reference) on the same batches and KV cache.

Without a GPU the kernels run in the Triton interpreter (on CPU tensors), so sizes stay tiny; small tiles and few
splits make even short sequences walk several key blocks and splits.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not installed: the Triton attention backend needs it")

from omnirun.attention.backend import AttentionContext, AttentionLayerSpec, HybridAttentionBackend, Rotary  # noqa: E402
from omnirun.attention.registry import portable_offers  # noqa: E402
from omnirun.attention.torch_native import TorchNativeAttention  # noqa: E402
from omnirun.batch import ForwardBatch, ForwardMode, build_batch  # noqa: E402
from omnirun.kernels.triton.attention_backend import TritonAttention  # noqa: E402
from omnirun.layers import native_ops  # noqa: E402
from omnirun.layers.rotary import cos_sin_table  # noqa: E402
from omnirun.memory import KVMemory, PageAllocator, PagedKVCache, ReqToTokenPool  # noqa: E402
from omnirun.platform import Capabilities  # noqa: E402
from omnirun.testing import fill_prefixes  # noqa: E402

pytestmark = pytest.mark.triton
DEVICE = torch.device("cpu")  # replaced per test by tests/kernels/conftest.py (the triton_device fixture)
CONTEXT_LEN = 192
FP8 = torch.float8_e4m3fn
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _fix_interpreter_for_numpy_2_4() -> None:
    """triton 3.6's interpreter turns 1-element arrays into loop bounds with int(), which numpy >= 2.4 rejects
    (triton-lang/triton#9171); `range(lo, hi, ...)` over loaded values then fails. Convert with .item()."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_omnirun_fixed", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    patched._omnirun_fixed = True
    interpreter._patch_lang_tensor = patched


if triton.knobs.runtime.interpret:
    _fix_interpreter_for_numpy_2_4()


@dataclasses.dataclass(frozen=True)
class Case:
    page_size: int
    head_dim: int
    num_heads: int
    num_kv_heads: int
    window: int | None
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    num_splits: int = 16
    block: int | None = None  # extend tile (BLOCK_M = BLOCK_N); None: the backend's default

    def __str__(self) -> str:
        kv = "fp8" if self.kv_dtype == FP8 else str(self.kv_dtype).removeprefix("torch.")
        return (
            f"ps{self.page_size}-d{self.head_dim}-h{self.num_heads}/{self.num_kv_heads}-w{self.window}-"
            f"{str(self.q_dtype).removeprefix('torch.')}-kv_{kv}-s{self.num_splits}-b{self.block}"
        )


# Page sizes 1/16, head dims 64/128 (and 96, not a power of two), GQA ratios 1/4/7 (7: Qwen2.5-0.5B's 14/2),
# sliding window on/off, float32/bfloat16 queries, fp8 e4m3 storage.
CASES = [
    Case(1, 64, 2, 2, None, torch.float32, torch.float32, num_splits=3, block=16),
    Case(16, 128, 4, 1, None, torch.bfloat16, torch.bfloat16, block=32),
    Case(16, 64, 14, 2, 9, torch.float32, torch.float32, num_splits=4, block=16),
    Case(1, 128, 14, 2, None, torch.bfloat16, FP8),
    Case(16, 64, 4, 1, 20, torch.bfloat16, FP8, num_splits=2, block=16),
    Case(1, 64, 8, 2, 33, torch.float32, FP8, block=32),
    Case(16, 96, 4, 2, None, torch.float32, torch.float32, num_splits=5, block=16),
    # One split: the split stage writes the output in the query dtype and the merge does not run.
    Case(16, 64, 8, 2, 21, torch.bfloat16, torch.bfloat16, num_splits=1, block=16),
    Case(1, 128, 4, 4, None, torch.float32, FP8, num_splits=1),
]


def make_setup(case: Case, seed: int) -> tuple[KVMemory, AttentionContext, AttentionLayerSpec]:
    """A one-layer paged KV cache whose every slot but the padding page holds random K/V."""
    torch.manual_seed(seed)
    num_pages = 1200 // case.page_size
    num_slots = (num_pages + 1) * case.page_size
    cache = PagedKVCache(1, num_slots, case.num_kv_heads, case.head_dim, case.kv_dtype, DEVICE, case.page_size)
    for buf in cache.k_buffers + cache.v_buffers:
        buf[case.page_size :] = torch.randn(num_slots - case.page_size, case.num_kv_heads, case.head_dim).to(buf)
    kv = KVMemory(
        PageAllocator(num_pages, case.page_size), ReqToTokenPool(6, CONTEXT_LEN, DEVICE), cache, case.page_size
    )
    context = AttentionContext(
        kv, DEVICE, case.q_dtype, case.num_heads, case.num_kv_heads, case.head_dim, max_context_len=CONTEXT_LEN
    )
    scaling = 0.8 / case.head_dim**0.5
    layer = AttentionLayerSpec(0, case.num_heads, case.num_kv_heads, case.head_dim, scaling, case.window)
    return kv, context, layer


def qkv(case: Case, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q = torch.randn(num_tokens, case.num_heads * case.head_dim, device=DEVICE).to(case.q_dtype)
    k = torch.randn(num_tokens, case.num_kv_heads * case.head_dim, device=DEVICE).to(case.q_dtype)
    v = torch.randn(num_tokens, case.num_kv_heads * case.head_dim, device=DEVICE).to(case.q_dtype)
    return q, k, v


def run(backend, q, k, v, layer, batch) -> torch.Tensor:
    backend.init_forward_metadata(batch)
    return backend.forward(q, k, v, layer, batch)


def assert_close(got: torch.Tensor, want: torch.Tensor, case: Case) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want.float(), atol=TOLERANCE[case.q_dtype], rtol=TOLERANCE[case.q_dtype])


def triton_backend(context: AttentionContext, case: Case) -> TritonAttention:
    return TritonAttention(context, case.num_splits, extend_block_m=case.block, extend_block_n=case.block)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_decode_matches_torch_native(case):
    kv, context, layer = make_setup(case, seed=1)
    rng = random.Random(case.head_dim + case.num_heads)
    # A request with nothing cached (one key: itself), short ones and ones long enough for several splits.
    prefix_lens = [0, rng.randint(1, 12), rng.randint(40, 90), rng.randint(130, 180)]
    rows = fill_prefixes(kv, prefix_lens)
    batch = build_batch(kv, rows, prefix_lens, [[1]] * len(rows), DEVICE)
    assert batch.mode is ForwardMode.DECODE
    q, k, v = qkv(case, batch.num_tokens)
    want = run(TorchNativeAttention(context), q, k, v, layer, batch)
    got = run(triton_backend(context, case), q, k, v, layer, batch)
    assert_close(got, want, case)


@pytest.mark.parametrize("with_prefix", [False, True], ids=["no_prefix", "prefix"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_extend_matches_torch_native(case, with_prefix):
    kv, context, layer = make_setup(case, seed=2)
    rng = random.Random(case.head_dim * 3 + case.num_heads + with_prefix)
    extend_lens = [rng.randint(20, 45), 1, rng.randint(2, 17)]
    prefix_lens = [rng.randint(1, 70), rng.randint(0, 40), 0] if with_prefix else [0, 0, 0]
    rows = fill_prefixes(kv, prefix_lens)
    new_tokens = [[1] * n for n in extend_lens]
    batch = build_batch(kv, rows, prefix_lens, new_tokens, DEVICE)
    assert batch.mode is ForwardMode.EXTEND
    q, k, v = qkv(case, batch.num_tokens)
    want = run(TorchNativeAttention(context), q, k, v, layer, batch)
    got = run(triton_backend(context, case), q, k, v, layer, batch)
    assert_close(got, want, case)


def padded(batch: ForwardBatch, size: int) -> ForwardBatch:
    """The batch grown to `size` the way a graph runner pads it: row 0, one key, writes to padding slot 0."""
    pad = size - batch.batch_size

    def grow(t: torch.Tensor, value: int) -> torch.Tensor:
        return torch.cat([t, torch.full((pad,), value, dtype=t.dtype, device=t.device)])

    return dataclasses.replace(
        batch,
        input_ids=grow(batch.input_ids, 0),
        positions=grow(batch.positions, 0),
        req_pool_indices=grow(batch.req_pool_indices, 0),
        seq_lens=grow(batch.seq_lens, 1),
        out_cache_loc=grow(batch.out_cache_loc, 0),
        seq_lens_cpu=grow(batch.seq_lens_cpu, 1),
        extend_prefix_lens_cpu=grow(batch.extend_prefix_lens_cpu, 0),
        extend_seq_lens_cpu=grow(batch.extend_seq_lens_cpu, 1),
    )


def test_graph_replay_reads_the_static_batch_the_runner_refills():
    case = Case(16, 64, 8, 2, None, torch.float32, torch.float32, num_splits=4)
    kv, context, layer = make_setup(case, seed=3)
    backend = triton_backend(context, case)
    backend.init_graph_state(max_batch_size=8)
    graph_size = 5
    reference = TorchNativeAttention(context)

    prefix_lens = [70, 3, 150]
    rows = fill_prefixes(kv, prefix_lens)
    # Capture: the metadata points at the graph runner's static batch, which holds harmless placeholders until the
    # runner refills it before a replay.
    static = padded(build_batch(kv, [kv.new_request()], [0], [[1]], DEVICE), graph_size)
    backend.init_forward_metadata_capture(static)
    captured = backend._decode
    assert captured.req_rows is static.req_pool_indices and captured.seq_lens is static.seq_lens
    q, k, v = qkv(case, graph_size)
    assert torch.isfinite(backend.forward(q, torch.zeros_like(k), torch.zeros_like(v), layer, static)).all()

    held = dict(zip(rows, prefix_lens, strict=True))
    for step_rows in (rows, rows[1:]):  # a second, smaller replay reads what the runner wrote over the first's
        lens = [held[row] for row in step_rows]
        batch = build_batch(kv, step_rows, lens, [[1]] * len(step_rows), DEVICE)
        held.update({row: n + 1 for row, n in zip(step_rows, lens, strict=True)})
        q, k, v = qkv(case, batch.batch_size)
        want = run(reference, q, k, v, layer, batch)

        refilled = padded(batch, graph_size)  # what the graph runner writes into the static batch
        static.req_pool_indices.copy_(refilled.req_pool_indices)
        static.seq_lens.copy_(refilled.seq_lens)
        backend.init_forward_metadata_replay(batch, graph_size)
        assert backend._decode is captured
        num_pad = graph_size - batch.batch_size
        q_pad, k_pad, v_pad = (torch.cat([t, torch.zeros(num_pad, t.shape[1], device=DEVICE)]) for t in (q, k, v))
        got = backend.forward_decode(q_pad, k_pad, v_pad, layer, refilled)
        assert torch.isfinite(got).all()
        assert_close(got[: batch.batch_size], want, case)
    with pytest.raises(ValueError, match="no graph of batch size 4"):
        backend.init_forward_metadata_replay(batch, 4)


def test_registry_offers_triton_only_where_capabilities_say_so():
    def caps(triton_ok: bool) -> Capabilities:
        return Capabilities("test", (torch.float32,), None, None, supports_triton=triton_ok)

    assert [o.name for o in portable_offers(caps(True))] == ["triton", "torch_native"]
    assert [o.name for o in portable_offers(caps(False))] == ["torch_native"]
    case = CASES[0]
    _, context, _ = make_setup(case, seed=4)
    triton, native = portable_offers(caps(True))
    assert isinstance(triton.build(context), TritonAttention) and triton.capturable
    assert isinstance(native.build(context), TorchNativeAttention) and not native.capturable
    assert TritonAttention.supports_graph


def test_large_decode_batches_take_fewer_splits():
    _, context, _ = make_setup(Case(1, 64, 8, 2, None, torch.float32, torch.float32), seed=4)
    backend = TritonAttention(context, num_splits=16)
    programs = TritonAttention.DECODE_PROGRAMS
    # 2 KV heads: 16 splits until the batch alone makes the programs, then fewer, down to one.
    assert backend.decode_splits(1) == 16 and backend.decode_splits(programs // 32) == 16
    assert backend.decode_splits(programs // 8) == 4 and backend.decode_splits(programs // 2) == 1
    assert backend.decode_splits(programs) == 1
    # Between them, powers of two: 256 // (2 * 22) -> 6 programs wanted, 8 taken (one kernel variant fewer).
    assert [backend.decode_splits(b) for b in (22, 25, 50, 75)] == [8, 8, 4, 2]
    assert TritonAttention(context, num_splits=3).decode_splits(1) == 3
    assert TritonAttention(context, num_splits=6).decode_splits(25) == 6  # never above num_splits


def test_a_large_decode_batch_in_one_split_matches_torch_native():
    case = Case(1, 64, 4, 2, None, torch.float32, torch.float32)
    kv, context, layer = make_setup(case, seed=5)
    backend = TritonAttention(context, num_splits=16)
    backend.DECODE_PROGRAMS = 2  # 3 requests x 2 KV heads already fill this "GPU": one split
    prefix_lens = [0, 7, 150]
    rows = fill_prefixes(kv, prefix_lens)
    batch = build_batch(kv, rows, prefix_lens, [[1]] * len(rows), DEVICE)
    assert backend.decode_splits(batch.batch_size) == 1
    q, k, v = qkv(case, batch.num_tokens)
    want = run(TorchNativeAttention(context), q, k, v, layer, batch)
    assert_close(run(backend, q, k, v, layer, batch), want, case)


def _rotary(case: Case, positions: torch.Tensor, calls: list) -> Rotary:
    """A Rotary applying the torch-native rotation, counting its calls (a fusing backend makes none)."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, case.head_dim, 2).float() / case.head_dim))
    table = cos_sin_table(inv_freq, 1.0, CONTEXT_LEN).to(DEVICE)

    def apply(q, k):
        calls.append(1)
        q2, k2 = native_ops.rotary_embedding(positions, q, k, table, case.head_dim)
        return q2.view(q.shape), k2.view(k.shape)

    return Rotary(positions, table, case.head_dim, apply)


@pytest.mark.parametrize("mode", ["decode", "extend"])
@pytest.mark.parametrize("case", [CASES[1], CASES[3], CASES[6]], ids=str)
def test_rotary_fused_into_the_store_equals_rotating_first(case, mode):
    """Handed the rotation, the backend fuses it into its KV store (never calling `apply`) and gives the output and
    cache bits of rotating first and storing after; through a hybrid backend too."""
    prefix_lens = [0, 9, 70]
    new_tokens = [[1]] * 3 if mode == "decode" else [[1] * 5, [1], [1] * 12]
    results = []
    for fused in (False, True, True):
        kv, context, layer = make_setup(case, seed=6)
        rows = fill_prefixes(kv, prefix_lens)
        batch = build_batch(kv, rows, prefix_lens, new_tokens, DEVICE)
        torch.manual_seed(7)
        q, k, v = qkv(case, batch.num_tokens)
        qkv_out = torch.cat([q, k, v], 1)  # strided views, as the model hands them over
        q, k, v = qkv_out.split([q.shape[1], k.shape[1], v.shape[1]], 1)
        calls: list = []
        rotary = _rotary(case, batch.positions, calls)
        backend = triton_backend(context, case)
        if len(results) == 2:  # the third run: the same backend behind a hybrid
            backend = HybridAttentionBackend(triton_backend(context, case), backend)
        backend.init_forward_metadata(batch)
        if fused:
            out = backend.forward(q, k, v, layer, batch, rotary)
            assert not calls
        else:
            q, k = rotary.apply(q, k)
            out = backend.forward(q, k, v, layer, batch)
        k_cache, v_cache = kv.kv_cache.get_kv(0)
        results.append((out, k_cache.clone(), v_cache.clone()))
    for got in results[1:]:
        for a, b in zip(got, results[0], strict=True):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_rotary_the_store_cannot_take_is_applied_first():
    """Inputs the fused kernel refuses (positions that are not contiguous here; `fuses_rotary` lists the rest) get
    `apply`, then the plain store: the same output as rotating first."""
    case = Case(1, 64, 4, 2, None, torch.bfloat16, torch.bfloat16)
    outs = []
    for handed_over in (False, True):
        kv, context, layer = make_setup(case, seed=8)
        rows = fill_prefixes(kv, [3, 20])
        batch = build_batch(kv, rows, [3, 20], [[1], [1]], DEVICE)
        torch.manual_seed(9)
        q, k, v = qkv(case, batch.num_tokens)
        calls: list = []
        strided = torch.stack([batch.positions, batch.positions], 1)[:, 0]
        assert not strided.is_contiguous()
        rotary = _rotary(case, strided, calls)
        backend = triton_backend(context, case)
        backend.init_forward_metadata(batch)
        if handed_over:
            outs.append(backend.forward(q, k, v, layer, batch, rotary))
            assert calls == [1]
        else:
            outs.append(backend.forward(*rotary.apply(q, k), v, layer, batch))
    assert torch.equal(outs[0], outs[1])


def test_a_decode_batch_beyond_the_grid_limit_is_refused_with_the_flag_to_change():
    from omnirun.kernels.triton.decode import MAX_DECODE_BATCH, decode_attention, partial_buffers

    batch = MAX_DECODE_BATCH + 1
    q = torch.zeros(batch, 1, 16, device=DEVICE)
    cache = torch.zeros(4, 1, 16, device=DEVICE)
    lengths = torch.ones(batch, dtype=torch.int32, device=DEVICE)
    rows = torch.zeros(batch, dtype=torch.int64, device=DEVICE)
    part_out, part_lse = partial_buffers(batch, 1, 1, 16, q.device)
    table = torch.zeros(1, 4, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="at most 65535 .* lower --max-running-requests"):
        decode_attention(q, cache, cache, table, rows, lengths, part_out, part_lse, torch.empty_like(q), 0.25)
