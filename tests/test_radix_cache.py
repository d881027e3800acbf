"""The prefix cache's radix tree on its own: matching whole pages, sharing by reference count, locks, LRU eviction
over unreferenced leaves, and the flush."""

from __future__ import annotations

import heapq
import random

import pytest
import torch

from omnirun.memory import KVMemory, PageAllocator, PagedKVCache, ReqToTokenPool, radix_cache
from omnirun.memory.radix_cache import RadixCache

CPU = torch.device("cpu")


def _kv(num_pages: int, page: int) -> KVMemory:
    kv = KVMemory(
        PageAllocator(num_pages, page),
        ReqToTokenPool(4, 64, CPU),
        PagedKVCache(1, (num_pages + 1) * page, 1, 4, torch.float32, CPU, page_size=page),
        page,
    )
    kv.attach_cache(RadixCache(kv))
    return kv


def _computed(kv: KVMemory, tokens: list[int]) -> tuple[int, list[int]]:
    """A request that computed `tokens`: its row and pages."""
    row = kv.new_request()
    assert kv.alloc_tokens([row], [0], [len(tokens)]) is not None
    return row, kv.pages_of(row)


def _finish(kv: KVMemory, tokens: list[int]) -> list[int]:
    """Compute `tokens` in a row, cache its full pages, release the row; returns the cached pages."""
    row, pages = _computed(kv, tokens)
    full = len(tokens) // kv.page_size
    kv.prefix_cache.insert(tokens[: full * kv.page_size], pages[:full])
    kv.release(row)
    return pages[:full]


@pytest.mark.parametrize("page", [1, 4])
def test_a_match_returns_the_pages_of_the_longest_cached_whole_page_prefix(page):
    kv = _kv(32, page)
    cache = kv.prefix_cache
    tokens = list(range(1, 4 * page + 1))
    pages = _finish(kv, tokens)
    assert cache.match(tokens, len(tokens))[0] == pages
    assert cache.match(tokens, len(tokens) - 1)[0] == pages[:3]  # a limit inside a page stops before it
    assert cache.match(tokens[: 2 * page] + [999] * page, 10 * page)[0] == pages[:2]
    assert cache.match([999] + tokens, 10 * page)[0] == []


def test_a_finished_request_leaves_its_full_pages_and_frees_the_partial_one():
    kv = _kv(8, 4)
    row, pages = _computed(kv, list(range(1, 11)))  # 10 tokens: two full pages and a partial one
    kv.prefix_cache.insert(list(range(1, 9)), pages[:2])
    kv.release(row)
    assert kv.refcounts(pages) == [1, 1, 0]  # the tree's reference; the partial page is free
    assert kv.allocator.free_count == 6 and kv.free_pages == 8 and kv.prefix_cache.cached_pages == 2


def test_a_shared_page_is_freed_only_when_its_last_holder_lets_go():
    kv = _kv(8, 1)
    cache = kv.prefix_cache
    pages = _finish(kv, [1, 2, 3])
    a, b = kv.new_request(), kv.new_request()
    for row in (a, b):
        kv.share_prefix(row, cache.match([1, 2, 3, 4], 3)[0])
    assert kv.refcounts(pages) == [3, 3, 3]
    kv.release(a)
    cache.flush()
    assert kv.refcounts(pages) == [1, 1, 1] and kv.allocator.free_count == 5  # b still reads them
    kv.release(b)
    assert kv.refcounts(pages) == [0, 0, 0] and kv.allocator.free_count == 8


def test_eviction_takes_the_least_recently_used_unreferenced_leaf_first():
    kv = _kv(16, 1)
    cache = kv.prefix_cache
    old = _finish(kv, [1, 2, 3])
    new = _finish(kv, [5, 6, 7])
    cache.match([1, 2, 3], 3)  # [1, 2, 3] is now the most recently used
    assert cache.evict(2) == 2
    assert kv.refcounts(new) == [1, 0, 0]  # from the tail of the older leaf
    assert cache.match([5, 6, 7], 3)[0] == new[:1] and cache.match([1, 2, 3], 3)[0] == old
    assert cache.evict(2) == 2  # [5] (now used less recently than [1 2 3]), then the tail of [1 2 3]
    assert kv.refcounts(new[:1] + old) == [0, 1, 1, 0]


def test_inner_nodes_go_only_after_their_children():
    kv = _kv(16, 1)
    cache = kv.prefix_cache
    stem = _finish(kv, [1, 2])
    leaf = _finish(kv, [1, 2, 3, 4])[2:]
    _, stem_node = cache.match([1, 2], 2)
    stem_node.last_access = 0  # even as the least recently used node, an inner one waits for its children
    assert cache.evict(1) == 1 and kv.refcounts(stem + leaf) == [1, 1, 1, 0]
    assert cache.evict(2) == 2 and kv.refcounts(stem + leaf) == [1, 0, 0, 0]


def test_a_locked_path_is_never_evicted_and_is_not_counted_as_evictable():
    kv = _kv(8, 1)
    cache = kv.prefix_cache
    locked = _finish(kv, [1, 2, 3])
    unlocked = _finish(kv, [7, 8])
    pages, node = cache.match([1, 2, 3, 4], 3)
    cache.lock(node)
    assert cache.evictable_pages == 2 and kv.free_pages == kv.allocator.free_count + 2
    assert cache.evict(5) == 2
    assert kv.refcounts(locked + unlocked) == [1, 1, 1, 0, 0]
    cache.unlock(node)
    assert cache.evictable_pages == 3 and cache.evict(5) == 3


def test_a_match_inside_a_node_splits_it_and_locks_only_the_matched_part():
    kv = _kv(8, 2)
    cache = kv.prefix_cache
    pages = _finish(kv, list(range(1, 9)))  # one node of 4 pages
    matched, node = cache.match([1, 2, 3, 4, 0, 0], 6)
    assert matched == pages[:2]
    cache.lock(node)
    assert cache.evictable_pages == 2
    assert cache.evict(4) == 2 and kv.refcounts(pages) == [1, 1, 0, 0]


def test_inserting_tokens_the_tree_has_keeps_the_trees_pages():
    kv = _kv(8, 1)
    cache = kv.prefix_cache
    first = _finish(kv, [1, 2])
    row, duplicate = _computed(kv, [1, 2, 3])  # computed [1 2] again, concurrently
    node = cache.insert([1, 2, 3], duplicate)
    assert cache.match([1, 2, 3, 9], 9)[0] == first + duplicate[2:]
    cache.lock(node)
    kv.release(row)
    assert kv.refcounts(duplicate) == [0, 0, 1] and cache.evictable_pages == 0
    cache.unlock(node)
    assert cache.evict(3) == 3 and kv.allocator.free_count == 8


def test_allocation_evicts_cached_pages_when_the_free_ones_run_short():
    kv = _kv(4, 1)
    cached = _finish(kv, [1, 2, 3])
    row = kv.new_request()
    assert kv.alloc_tokens([row], [0], [3]) is not None  # 1 free page + 2 evicted
    assert sorted(kv.pages_of(row)) == sorted([*cached[1:], 4]) and kv.prefix_cache.match([1, 2], 2)[0] == cached[:1]
    assert kv.alloc_tokens([row], [3], [5]) is None  # 1 evictable page, 2 needed: nothing changes
    assert kv.prefix_cache.cached_pages == 1 and kv.num_tokens_of(row) == 3


def test_a_flush_drops_every_page_and_old_locks_do_not_reach_the_new_tree():
    kv = _kv(8, 1)
    cache = kv.prefix_cache
    _finish(kv, [1, 2, 3])
    _, node = cache.match([1, 2, 3], 3)
    cache.lock(node)
    cache.flush()
    assert kv.allocator.free_count == 8 and cache.cached_pages == 0 and cache.evictable_pages == 0
    _finish(kv, [4, 5])
    cache.unlock(node)  # a request that held the old tree goes away
    assert cache.evictable_pages == 2


def test_shared_prefix_entries_are_written_with_the_rows_next_batch():
    kv = _kv(8, 2)
    cache = kv.prefix_cache
    pages = _finish(kv, [1, 2, 3, 4])
    kv.new_request()
    row = kv.new_request()  # a row never used: its table entries are still zero
    kv.share_prefix(row, cache.match([1, 2, 3, 4, 5], 4)[0])
    assert kv.req_to_token.table[row, :4].tolist() == [0, 0, 0, 0]  # not before a batch needs them
    step = kv.alloc_step([row], [4], [5])
    slots = [p * 2 + i for p in pages for i in range(2)]
    assert kv.req_to_token.table[row, :4].tolist() == slots
    assert step.prefix_entries.tolist() == [[row] * 4, [0, 1, 2, 3], slots]
    assert kv.alloc_step([row], [5], [6]).prefix_entries is None  # once


def test_sharing_into_a_row_that_holds_tokens_or_a_free_page_is_refused():
    kv = _kv(8, 1)
    row, _ = _computed(kv, [1])
    with pytest.raises(ValueError, match="already holds tokens"):
        kv.share_prefix(row, [2])
    with pytest.raises(ValueError, match="page 5: it is free"):
        kv.share_prefix(kv.new_request(), [5])
    with pytest.raises(ValueError, match="whole pages"):
        kv.prefix_cache.insert([1, 2], [1])


def _evict_by_walking_the_tree(cache: RadixCache, num_pages: int) -> int:
    """The plain definition of eviction, the reference: every evictable leaf of the tree in (last use, id) order,
    each from its tail, a parent joining once its last child is gone."""
    leaves = [(n.last_access, id(n), n) for n in cache._nodes() if not n.children and n.lock_ref == 0]
    heapq.heapify(leaves)
    freed = 0
    while freed < num_pages and leaves:
        _, _, leaf = heapq.heappop(leaves)
        take = min(num_pages - freed, len(leaf.pages))
        cache.kv.drop(leaf.pages[len(leaf.pages) - take :])
        freed += take
        cache.cached_pages -= take
        cache.evictable_pages -= take
        if take < len(leaf.pages):
            del leaf.pages[len(leaf.pages) - take :]
            del leaf.key[len(leaf.pages) * cache.page_size :]
            continue
        parent = leaf.parent
        del parent.children[tuple(leaf.key[: cache.page_size])]
        if parent is not cache.root and not parent.children and parent.lock_ref == 0:
            heapq.heappush(leaves, (parent.last_access, id(parent), parent))
    return freed


@pytest.mark.parametrize("slack", [64, 0], ids=["heap", "rebuilt-often"])
@pytest.mark.parametrize("seed", range(6))
def test_eviction_frees_the_pages_the_whole_tree_walk_would(seed, slack, monkeypatch):
    """Random inserts sharing prefixes, matches, locks and unlocks, and evictions, on two caches: the heap of
    leaves must free exactly the pages (and leave exactly the counts) that walking the whole tree frees, also
    when the heap is rebuilt from the tree at nearly every offer."""
    monkeypatch.setattr(radix_cache, "HEAP_SLACK", slack)
    rng = random.Random(seed)
    page = rng.choice([1, 2, 4])
    ours, reference = _kv(512, page), _kv(512, page)
    monkeypatch.setattr(
        reference.prefix_cache, "evict", lambda n: _evict_by_walking_the_tree(reference.prefix_cache, n)
    )
    stems = [[rng.randrange(50) for _ in range(rng.randrange(0, 4) * page)] for _ in range(4)]
    locked: list[tuple] = []
    for _ in range(300):
        op = rng.random()
        if op < 0.4:
            tokens = rng.choice(stems) + [rng.randrange(50) for _ in range(rng.randrange(1, 5) * page)]
            if ours.allocator.free_count < len(tokens) + 8:
                continue
            for kv in (ours, reference):
                _finish(kv, tokens)
        elif op < 0.6:
            tokens = rng.choice(stems) + [rng.randrange(50) for _ in range(2 * page)]
            nodes = [kv.prefix_cache.match(tokens, len(tokens))[1] for kv in (ours, reference)]
            if rng.random() < 0.5:
                for kv, node in zip((ours, reference), nodes, strict=True):
                    kv.prefix_cache.lock(node)
                locked.append(tuple(nodes))
        elif op < 0.75 and locked:
            for kv, node in zip((ours, reference), locked.pop(rng.randrange(len(locked))), strict=True):
                kv.prefix_cache.unlock(node)
        else:
            n = rng.randrange(1, 12)
            assert ours.prefix_cache.evict(n) == reference.prefix_cache.evict(n)
        assert ours.refcounts(range(1, 513)) == reference.refcounts(range(1, 513))
        assert (ours.prefix_cache.cached_pages, ours.prefix_cache.evictable_pages) == (
            reference.prefix_cache.cached_pages,
            reference.prefix_cache.evictable_pages,
        )


def test_eviction_does_not_walk_the_tree():
    """Its cost follows what it frees: with 400 cached requests, evicting a page at a time never visits them all."""
    kv = _kv(2048, 4)
    for i in range(400):
        _finish(kv, [i, i + 1, i + 2, i + 3, 7, 7, 7, 7])
    cache = kv.prefix_cache

    def walk():
        raise AssertionError("evict walked the whole tree")

    cache._nodes = walk
    for _ in range(100):
        assert cache.evict(1) == 1
