"""Memory bookkeeping the mutation run found unchecked: which bad page id an error names, release_all, a request
row's in-use flag at the ends of the range, and the bytes of live KV caches a host probe subtracts."""

from __future__ import annotations

import gc

import pytest
import torch

from omnirun.memory import KVMemory, PageAllocator, PagedKVCache, ReqToTokenPool
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
    assert not pool.in_use(0) and pool.in_use(2)


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
