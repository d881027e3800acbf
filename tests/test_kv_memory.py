"""KVMemory (slot layout, all-or-nothing, release), PagedKVCache and ReqToTokenPool."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omnirun.errors import ConfigError
from omnirun.memory import KVMemory, PageAllocator, PagedKVCache, ReqToTokenPool

CPU = torch.device("cpu")


def make_memory(num_pages: int, page_size: int, max_requests: int = 4, context: int = 64) -> KVMemory:
    num_slots = (num_pages + 1) * page_size
    return KVMemory(
        PageAllocator(num_pages, page_size),
        ReqToTokenPool(max_requests, context, CPU),
        PagedKVCache(2, num_slots, 2, 4, torch.float32, CPU, page_size=page_size),
        page_size,
    )


def check_layout(mem: KVMemory, row: int) -> None:
    """Every token's slot follows the page layout, and the table row holds exactly those slots."""
    ps = mem.page_size
    pages = mem.pages_of(row)
    n = mem.num_tokens_of(row)
    assert len(pages) == -(-n // ps), "a request holds exactly the pages its tokens need"
    expected = [pages[p // ps] * ps + p % ps for p in range(n)]
    assert mem.req_to_token.table[row, :n].tolist() == expected


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_slots_follow_the_page_layout(page_size):
    mem = make_memory(num_pages=40, page_size=page_size)
    a, b = mem.new_request(), mem.new_request()
    slots = mem.alloc_tokens([a, b], [0, 0], [5, 3])
    assert slots.dtype == torch.int64 and slots.device.type == "cpu" and slots.shape == (8,)
    for row, positions, got in ((a, range(5), slots[:5]), (b, range(3), slots[5:])):
        pages = mem.pages_of(row)
        for p, slot in zip(positions, got.tolist(), strict=True):
            assert slot // page_size in pages and slot // page_size != 0
            assert slot % page_size == p % page_size
            assert slot // page_size == pages[p // page_size]
        check_layout(mem, row)
    assert len(set(slots.tolist())) == 8


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_partial_pages_are_filled_before_new_ones(page_size):
    mem = make_memory(num_pages=20, page_size=page_size)
    row = mem.new_request()
    first = mem.alloc_tokens([row], [0], [1])
    pages_after_first = mem.pages_of(row)
    assert len(pages_after_first) == 1
    # Decode steps: one token at a time, a new page only every page_size tokens.
    slots = [int(first[0])]
    for pos in range(1, 2 * page_size + 1):
        assert mem.pages_needed([row], [pos], [pos + 1]) == (1 if pos % page_size == 0 else 0)
        slots.append(int(mem.alloc_tokens([row], [pos], [pos + 1])[0]))
    assert slots[:page_size] == [pages_after_first[0] * page_size + i for i in range(page_size)]
    assert len(mem.pages_of(row)) == 3
    check_layout(mem, row)


def test_extend_after_partial_page_continues_in_it():
    mem = make_memory(num_pages=10, page_size=4)
    row = mem.new_request()
    s1 = mem.alloc_tokens([row], [0], [3])
    assert mem.pages_needed([row], [3], [9]) == 2  # 1 slot left in page one, then 5 more tokens: 2 pages
    s2 = mem.alloc_tokens([row], [3], [9])
    p = mem.pages_of(row)
    assert s1.tolist() == [p[0] * 4 + i for i in range(3)]
    assert s2.tolist() == [p[0] * 4 + 3] + [p[1] * 4 + i for i in range(4)] + [p[2] * 4]
    check_layout(mem, row)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_all_or_nothing_on_exhaustion(page_size):
    mem = make_memory(num_pages=3, page_size=page_size)
    a, b = mem.new_request(), mem.new_request()
    mem.alloc_tokens([a], [0], [2 * page_size])  # two pages
    table_before = mem.req_to_token.table.clone()
    free_before = mem.free_tokens
    # b's two pages do not fit next to a's second page: nothing is taken for either.
    assert mem.pages_needed([a, b], [2 * page_size, 0], [2 * page_size + 1, page_size + 1]) == 3
    assert mem.alloc_tokens([a, b], [2 * page_size, 0], [2 * page_size + 1, page_size + 1]) is None
    assert mem.free_tokens == free_before
    assert torch.equal(mem.req_to_token.table, table_before)
    assert mem.pages_of(b) == [] and mem.num_tokens_of(a) == 2 * page_size
    # The same request for b alone fits.
    assert mem.alloc_tokens([b], [0], [page_size]) is not None
    assert mem.free_tokens == 0


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_release_returns_every_page(page_size):
    mem = make_memory(num_pages=12, page_size=page_size, max_requests=2)
    assert mem.total_tokens == 12 * page_size == mem.free_tokens
    a, b = mem.new_request(), mem.new_request()
    assert mem.new_request() is None
    mem.alloc_tokens([a, b], [0, 0], [3 * page_size - 1, page_size + 1])
    mem.release(a)
    mem.release(b)
    assert mem.free_tokens == mem.total_tokens
    with pytest.raises(ValueError, match="not live"):
        mem.release(a)
    assert mem.new_request() is not None


def test_empty_and_zero_length_batches():
    mem = make_memory(num_pages=2, page_size=4)
    row = mem.new_request()
    assert mem.alloc_tokens([], [], []).numel() == 0
    assert mem.alloc_tokens([row], [0], [0]).numel() == 0
    assert mem.pages_of(row) == []


def test_bad_batches_raise():
    mem = make_memory(num_pages=4, page_size=4, context=8)
    row = mem.new_request()
    with pytest.raises(ValueError, match="holds 0 tokens, but start is 2"):
        mem.alloc_tokens([row], [2], [4])
    with pytest.raises(ValueError, match="context length"):
        mem.alloc_tokens([row], [0], [9])
    with pytest.raises(ValueError, match="twice"):
        mem.alloc_tokens([row, row], [0, 0], [1, 1])
    with pytest.raises(ValueError, match="not live"):
        mem.alloc_tokens([3], [0], [1])
    assert mem.free_tokens == mem.total_tokens


def test_mismatched_parts_are_a_config_error():
    with pytest.raises(ConfigError, match="num_slots=20"):
        KVMemory(PageAllocator(4, 4), ReqToTokenPool(1, 8, CPU), PagedKVCache(1, 16, 1, 1, torch.float32, CPU, 4), 4)
    with pytest.raises(ConfigError, match="page_size=4"):
        KVMemory(PageAllocator(4, 4), ReqToTokenPool(1, 8, CPU), PagedKVCache(1, 20, 1, 1, torch.float32, CPU), 4)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    page_size=st.sampled_from([1, 4, 16]),
    ops=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 2), st.integers(1, 20)), max_size=40),
)
def test_interleaved_requests_never_share_a_slot(page_size, ops):
    """Random growth (batched), release and restart of 4 requests: live tokens never share a slot."""
    mem = make_memory(num_pages=12, page_size=page_size, max_requests=4, context=64)
    live: dict[int, list[int]] = {}  # row -> slots of its tokens
    for who, action, grow in ops:
        if action == 0 and len(live) < 4:
            row = mem.new_request()
            live[row] = []
        elif action == 1 and live:
            row = sorted(live)[who % len(live)]
            mem.release(row)
            del live[row]
        elif live:
            # Grow up to two requests in one batch.
            rows = sorted(live)[who % len(live) :][:2]
            starts = [len(live[r]) for r in rows]
            ends = [min(s + grow, 64) for s in starts]
            needed = mem.pages_needed(rows, starts, ends)
            free_before = mem.free_tokens
            slots = mem.alloc_tokens(rows, starts, ends)
            if slots is None:
                assert needed * page_size > free_before
                assert mem.free_tokens == free_before
                continue
            assert mem.free_tokens == free_before - needed * page_size
            offset = 0
            for r, s, e in zip(rows, starts, ends, strict=True):
                live[r] += slots[offset : offset + e - s].tolist()
                offset += e - s
        all_slots = [s for slots in live.values() for s in slots]
        assert len(all_slots) == len(set(all_slots)), "two live tokens share a slot"
        assert all(s >= page_size for s in all_slots), "a token was placed in the padding page"
        held_pages = sum(len(mem.pages_of(r)) for r in live)
        assert mem.free_tokens == mem.total_tokens - held_pages * page_size
        for row, slots in live.items():
            assert mem.num_tokens_of(row) == len(slots)
            assert mem.req_to_token.table[row, : len(slots)].tolist() == slots
            check_layout(mem, row)
    for row in list(live):
        mem.release(row)
    assert mem.free_tokens == mem.total_tokens


# --- PagedKVCache ---


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("page_size", [1, 4])
def test_kv_cache_round_trip(dtype, page_size):
    torch.manual_seed(0)
    cache = PagedKVCache(3, 10 * page_size, 2, 8, dtype, CPU, page_size=page_size)
    assert cache.dtype == dtype
    assert len(cache.k_buffers) == len(cache.v_buffers) == 3
    for buf in cache.k_buffers + cache.v_buffers:
        assert buf.shape == (10 * page_size, 2, 8) and buf.dtype == dtype
        assert torch.count_nonzero(buf[:page_size].float()) == 0, "the padding page must be zeroed"
    slots = torch.tensor([page_size + 3, 5 * page_size, 2 * page_size + 1])
    k = torch.randn(3, 2, 8, dtype=torch.bfloat16)
    v = torch.randn(3, 2, 8, dtype=torch.bfloat16)
    cache.set_kv(1, slots, k, v)
    k_buf, v_buf = cache.get_kv(1)
    assert k_buf is cache.k_buffers[1] and v_buf is cache.v_buffers[1]
    # Stored as a plain cast to the storage dtype (scale 1).
    assert torch.equal(k_buf[slots].float(), k.to(dtype).float())
    assert torch.equal(v_buf[slots].float(), v.to(dtype).float())
    if dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(k_buf[slots].to(torch.bfloat16), k)
    assert torch.count_nonzero(k_buf[:page_size].float()) == 0


def test_kv_cache_rejects_wrong_shapes():
    cache = PagedKVCache(1, 4, 2, 8, torch.float32, CPU)
    with pytest.raises(ValueError, match=r"\[n, 2, 8\]"):
        cache.set_kv(0, torch.tensor([1]), torch.zeros(1, 2, 4), torch.zeros(1, 2, 4))


def test_bytes_per_token():
    # Llama-3-8B shapes: 32 layers, 8 KV heads, head_dim 128, bf16 -> 128 KiB per token.
    assert PagedKVCache.bytes_per_token(32, 8, 128, torch.bfloat16) == 131072
    assert PagedKVCache.bytes_per_token(32, 8, 128, torch.float8_e4m3fn) == 65536
    cache = PagedKVCache(2, 6, 1, 4, torch.float32, CPU)
    assert cache.nbytes == sum(b.numel() * b.element_size() for b in cache.k_buffers + cache.v_buffers)


# --- ReqToTokenPool ---


def test_req_to_token_pool():
    pool = ReqToTokenPool(3, 16, CPU)
    assert pool.table.shape == (3, 16) and pool.table.dtype == torch.int32
    assert torch.count_nonzero(pool.table) == 0
    rows = [pool.alloc() for _ in range(3)]
    assert sorted(rows) == [0, 1, 2] and pool.free_count == 0
    assert pool.alloc() is None
    pool.free(1)
    assert pool.free_count == 1 and not pool.in_use(1)
    with pytest.raises(ValueError, match="double free"):
        pool.free(1)
    with pytest.raises(ValueError, match="valid rows"):
        pool.free(3)
    assert pool.alloc() == 1
