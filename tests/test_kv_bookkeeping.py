"""KV memory bookkeeping: which bad page id an error names, release_all, a request
row's in-use flag at the ends of the range, and the bytes of live KV caches a host probe subtracts."""

from __future__ import annotations

import gc

import pytest
import torch

from omnirun.errors import ConfigError, KVPoolTooSmallError
from omnirun.memory import KVMemory, PageAllocator, PagedKVCache, ReqToTokenPool, plan_kv_pool
from omnirun.memory.kv_cache import _is_one_byte_float

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    ("pages", "message"),
    [
        ([0, 2], "cannot free page 0: page 0 is the reserved padding page"),
        ([2, -3], "cannot free page -3: valid ids are 1..4"),
        ([1, 5], "cannot free page 5: valid ids are 1..4"),
        ([0, 9], "cannot free page 0: page 0 is the reserved padding page"),  # the low one when both are bad
    ],
)
def test_freeing_a_page_outside_the_pool_names_the_bad_id(pages, message):
    allocator = PageAllocator(num_pages=4, page_size=2)
    allocator.alloc(4)
    with pytest.raises(ValueError) as excinfo:
        allocator.free(pages)
    assert str(excinfo.value) == message
    assert allocator.free_count == 0  # nothing freed


def test_release_all_frees_every_live_request_and_only_those():
    page_size = 4
    mem = KVMemory(
        PageAllocator(10, page_size),
        ReqToTokenPool(4, 32, CPU),
        PagedKVCache(1, 11 * page_size, 1, 2, torch.float32, CPU, page_size=page_size),
        page_size,
    )
    a, b, c = mem.new_request(), mem.new_request(), mem.new_request()
    mem.alloc_tokens([a, b, c], [0, 0, 0], [5, 9, 1])  # 2 + 3 + 1 pages
    mem.release(b)  # a dead row in the middle: release_all must skip it, not free it twice
    assert mem.allocator.free_count == 10 - 3
    mem.release_all()
    assert mem.allocator.free_count == 10
    assert mem.req_to_token.free_count == 4
    for row in (a, b, c):
        assert not mem.req_to_token.in_use(row)
        with pytest.raises(ValueError, match="is not live"):
            mem.pages_of(row)


def test_in_use_at_the_ends_of_the_row_range():
    pool = ReqToTokenPool(max_requests=3, max_context_len=8, device=CPU)
    rows = [pool.alloc() for _ in range(3)]
    assert rows == [0, 1, 2]
    assert [pool.in_use(r) for r in (-1, 0, 1, 2, 3)] == [False, True, True, True, False]
    pool.free(0)
    assert pool.in_use(0) is False and pool.in_use(2) is True
    with pytest.raises(ValueError) as excinfo:
        pool.free(3)
    assert str(excinfo.value) == "cannot free request row 3: valid rows are 0..2"


def _memory(num_pages: int, page_size: int) -> KVMemory:
    return KVMemory(
        PageAllocator(num_pages, page_size),
        ReqToTokenPool(4, 32, CPU),
        PagedKVCache(1, (num_pages + 1) * page_size, 1, 2, torch.float32, CPU, page_size=page_size),
        page_size,
    )


def test_three_requests_taking_new_pages_in_one_batch_get_distinct_pages():
    mem = _memory(12, 2)
    rows = [mem.new_request() for _ in range(3)]
    mem.alloc_tokens(rows, [0, 0, 0], [3, 1, 4])  # 2 + 1 + 2 pages: pages 1-5 in batch order
    assert [mem.pages_of(r) for r in rows] == [[1, 2], [3], [4, 5]]
    slots = mem.alloc_tokens(rows, [3, 1, 4], [5, 4, 5])  # 1 + 1 + 1 more: 6, 7, 8
    assert [mem.pages_of(r) for r in rows] == [[1, 2, 6], [3, 7], [4, 5, 8]]
    # request 0: positions 3 (page 2), 4 (page 6); 1: 1 (page 3), 2, 3 (page 7); 2: 4 (page 8)
    assert slots.tolist() == [2 * 2 + 1, 6 * 2, 3 * 2 + 1, 7 * 2, 7 * 2 + 1, 8 * 2]
    for row in rows:
        n = mem.num_tokens_of(row)
        assert mem.req_to_token.table[row, :n].tolist() == [mem.pages_of(row)[p // 2] * 2 + p % 2 for p in range(n)]


def test_a_batch_without_new_tokens_gives_an_empty_int64_tensor():
    mem = _memory(4, 2)
    row = mem.new_request()
    slots = mem.alloc_tokens([row], [0], [0])
    assert slots.dtype == torch.int64 and slots.numel() == 0


def test_reserved_bytes_counts_the_live_caches_of_that_device_type():
    gc.collect()  # caches of earlier tests that are garbage leave the weak set now, not during the test
    before_cpu, before_cuda = PagedKVCache.reserved_bytes("cpu"), PagedKVCache.reserved_bytes("cuda")
    cache = PagedKVCache(3, 10, 2, 8, torch.bfloat16, CPU, page_size=2)
    # 10 slots x K and V x 3 layers x 2 heads x 8 dims x 2 bytes
    assert PagedKVCache.reserved_bytes("cpu") - before_cpu == 10 * 2 * 3 * 2 * 8 * 2
    assert PagedKVCache.reserved_bytes("cuda") == before_cuda
    del cache


@pytest.mark.parametrize(
    ("dtype", "one_byte_float"),
    [
        (torch.float8_e4m3fn, True),
        (torch.float8_e5m2, True),
        (torch.float8_e4m3fnuz, True),
        (torch.bfloat16, False),
        (torch.float16, False),
        (torch.float32, False),
        (torch.int8, False),
        (torch.uint8, False),
    ],
)
def test_only_fp8_storage_takes_the_byte_view(dtype, one_byte_float):
    """Indexed fp8 stores are missing on some devices (CPU has them, so set_kv's result cannot tell): the byte view
    is for one-byte floats, and only for them."""
    assert _is_one_byte_float(dtype) is one_byte_float


def test_kv_memory_refuses_an_allocator_of_another_page_size_with_the_fix():
    with pytest.raises(ConfigError) as excinfo:
        KVMemory(
            PageAllocator(4, 2),
            ReqToTokenPool(2, 8, CPU),
            PagedKVCache(1, 5 * 4, 1, 2, torch.float32, CPU, page_size=4),
            4,
        )
    assert str(excinfo.value) == "PageAllocator has page_size 2: build it with page_size=4"


def test_rows_outside_the_table_are_not_live_not_other_rows():
    mem = _memory(8, 2)
    rows = [mem.new_request() for _ in range(4)]  # every row live, the last one included
    mem.alloc_tokens(rows, [0] * 4, [1] * 4)
    for row in (-1, 4):  # -1 would index the last row from the end
        with pytest.raises(ValueError, match=rf"request row {row} is not live"):
            mem.pages_of(row)


def test_a_batch_whose_lists_differ_in_length_says_so():
    mem = _memory(4, 2)
    row = mem.new_request()
    with pytest.raises(ValueError) as excinfo:
        mem.alloc_tokens([row, 1], [0], [1])
    assert str(excinfo.value) == "rows, starts and ends differ in length: 2, 1, 1"


def test_a_request_may_fill_the_context_length_exactly_and_not_more():
    mem = _memory(16, 2)  # the table holds 32 positions per row
    row = mem.new_request()
    assert mem.alloc_tokens([row], [0], [32]).numel() == 32
    other = mem.new_request()
    with pytest.raises(ValueError, match=r"end 33 must be in \[0, 32\]"):
        mem.alloc_tokens([other], [0], [33])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((0, 8), "max_requests must be >= 1, got 0"),
        ((2, 0), "max_context_len must be >= 1, got 0"),
    ],
)
def test_req_to_token_pool_refuses_an_empty_table_naming_the_argument(args, message):
    with pytest.raises(ValueError) as excinfo:
        ReqToTokenPool(*args, CPU)
    assert str(excinfo.value) == message


def test_the_smallest_req_to_token_pool_and_kv_cache_are_accepted():
    pool = ReqToTokenPool(1, 1, CPU)
    assert pool.table.shape == (1, 1) and pool.alloc() == 0
    cache = PagedKVCache(1, 3, 1, 1, torch.float32, CPU, page_size=3)  # just the padding page
    assert cache.num_slots == 3
    assert PagedKVCache(1, 1, 1, 1, torch.float32, CPU).page_size == 1  # one slot a page unless told


def test_a_row_that_was_never_handed_out_cannot_be_freed():
    pool = ReqToTokenPool(3, 8, CPU)
    with pytest.raises(ValueError, match="double free: request row 1 is not in use"):
        pool.free(1)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_layers": 0}, "num_layers must be >= 1, got 0"),
        ({"num_kv_heads": 0}, "num_kv_heads must be >= 1, got 0"),
        ({"head_dim": -1}, "head_dim must be >= 1, got -1"),
        ({"page_size": 0}, "page_size must be >= 1, got 0"),
        ({"num_slots": 3}, "num_slots (3) must hold at least the padding page (4 slots)"),
    ],
)
def test_kv_cache_refuses_bad_sizes_naming_the_argument(kwargs, message):
    args = {"num_layers": 1, "num_slots": 8, "num_kv_heads": 1, "head_dim": 2, "page_size": 4, **kwargs}
    with pytest.raises(ValueError) as excinfo:
        PagedKVCache(dtype=torch.float32, device=CPU, **args)
    assert str(excinfo.value) == message


def test_the_buffers_live_on_the_device_asked_for():
    """On the meta device (no memory, any host), so that a buffer left on the default device shows."""
    cache = PagedKVCache(2, 8, 1, 2, torch.float32, "meta", page_size=2)
    assert cache.device == torch.device("meta")
    assert all(buf.device.type == "meta" for buf in cache.k_buffers + cache.v_buffers)
    assert ReqToTokenPool(2, 4, "meta").table.device.type == "meta"


def _plan(free_bytes: int, **overrides):
    # 1 byte a token, pages of 1, the request table 1 x 100 x 4 = 400 bytes: `free_bytes - 400` tokens fit, one
    # of them the padding page
    args = dict(
        free_bytes=free_bytes,
        total_bytes=1000,
        mem_fraction_static=1.0,
        bytes_per_token=1,
        page_size=1,
        context_length=100,
        max_running_requests=1,
        reserved_bytes=0,
    )
    return plan_kv_pool(**{**args, **overrides})


def test_the_explanation_of_a_pool_that_memory_caps_ends_with_the_pool_and_that_cap():
    plan = _plan(1200 + 201, total_bytes=2000, max_running_requests=3)  # 3 requests could fill 300 tokens
    assert plan.num_tokens == 200
    assert plan.explanation.endswith(
        "1 B/token -> 201 tokens = 200 pages of 1 + 1 padding page; caps in pages: running limit "
        "--max-running-requests 3 x context length 100: 300, memory (mem_fraction_static 1): 200; "
        "pool 200 tokens in 200 pages, capped by memory (mem_fraction_static 1)"
    )


@pytest.mark.parametrize(
    ("cap", "suggests_the_cap"),
    [
        (40, True),  # the cap is what keeps the pool small: raising it helps
        (50, False),  # the cap is exactly what fits: raising it does not
        (80, False),  # the cap does not fit anyway
    ],
)
def test_a_pool_too_small_suggests_raising_the_cap_only_when_the_cap_is_what_limits_it(cap, suggests_the_cap):
    with pytest.raises(KVPoolTooSmallError) as excinfo:
        _plan(400 + 51, max_total_tokens=cap)  # 50 pages fit, fewer than the context length of 100
    message = str(excinfo.value)
    assert ("raise --max-total-tokens" in message) is suggests_the_cap
    assert "raise --mem-fraction-static (now 1), lower --context-length" in message


def test_an_impossible_memory_probe_says_what_a_platform_must_return():
    with pytest.raises(ConfigError) as excinfo:
        _plan(2000)  # free > total
    assert str(excinfo.value) == (
        "device memory probe gave free=2000 total=1000 bytes: the platform's memory_info() must return "
        "0 <= free <= total, total > 0"
    )


@pytest.mark.parametrize("dtype", [torch.bool, torch.float32, torch.complex64])
def test_page_ids_of_a_non_integer_dtype_are_refused(dtype):
    allocator = PageAllocator(num_pages=4, page_size=1)
    allocator.alloc(2)
    with pytest.raises(ValueError, match=f"page ids must be integers, got a {dtype} tensor"):
        allocator.free(torch.ones(1, dtype=dtype))  # True / 1.0 would otherwise free page 1
    assert allocator.free_count == 2


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: PageAllocator(-1, 1), "num_pages must be >= 0, got -1"),
        (lambda: PageAllocator(4, 0), "page_size must be >= 1, got 0"),
        (lambda: PageAllocator(4, 1).alloc(-2), "cannot allocate a negative number of pages (-2)"),
    ],
)
def test_page_allocator_refusals_name_the_value(call, message):
    with pytest.raises(ValueError) as excinfo:
        call()
    assert str(excinfo.value) == message
