"""The KV state of the runner: which pages and slots each running request owns.

The scheduler drives it: `new_request()` when a request starts, `alloc_tokens()` before each forward pass for the
tokens the pass will write, `release()` when the request finishes. Page lists are kept on the host, so computing
slots never reads the device; the device sees one indexed write of the request-to-token table per batch.

Pages are reference-counted: a request row holds one reference on each of its pages, and an attached prefix cache
one on each page it keeps; a page goes back to the allocator when its last holder lets go. A row may start with
pages the cache shares (`share_prefix`); their table entries are written with the row's next batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch

from omnirun.errors import ConfigError
from omnirun.memory.kv_cache import PagedKVCache
from omnirun.memory.page_allocator import PageAllocator
from omnirun.memory.req_to_token import ReqToTokenPool

if TYPE_CHECKING:
    from omnirun.memory.radix_cache import RadixCache


class StepSlots(NamedTuple):
    """What `alloc_step` hands a batch: the slots of its new tokens and their positions, and the table entries of
    prefixes shared into its rows since their last batch ([3, n] int64 on the host: rows, positions, slots; None
    when there are none) -- the other ranks of a tensor-parallel group write those from the batch too."""

    out_cache_loc: torch.Tensor
    prefix_entries: torch.Tensor | None
    positions: torch.Tensor


class KVMemory:
    """Pages, slots and request rows of the paged KV cache.

    A request's token at position p lives in slot `page * page_size + p % page_size`, where `page` is the
    request's (p // page_size)-th page.
    """

    def __init__(
        self,
        allocator: PageAllocator,
        req_to_token: ReqToTokenPool,
        kv_cache: PagedKVCache,
        page_size: int,
    ):
        if allocator.page_size != page_size:
            raise ConfigError(f"PageAllocator has page_size {allocator.page_size}: build it with page_size={page_size}")
        if kv_cache.page_size != page_size:
            # The cache zeroes only its own idea of page 0; a bigger page would leave padding slots uninitialised.
            raise ConfigError(f"PagedKVCache has page_size {kv_cache.page_size}: build it with page_size={page_size}")
        needed_slots = (allocator.num_pages + 1) * page_size
        if kv_cache.num_slots < needed_slots:
            raise ConfigError(
                f"PagedKVCache has {kv_cache.num_slots} slots but {allocator.num_pages} pages of {page_size} plus "
                f"the padding page need {needed_slots}: build it with num_slots={needed_slots}"
            )
        self.allocator = allocator
        self.req_to_token = req_to_token
        self.kv_cache = kv_cache
        self._page_size = page_size
        # Per request row: its page ids in order (None: row not live) and how many tokens it holds.
        self._pages: list[list[int] | None] = [None] * req_to_token.max_requests
        self._num_tokens: list[int] = [0] * req_to_token.max_requests
        # Holders of each page (rows using it, plus 1 while the prefix cache keeps it); 0: free.
        self._refs = torch.zeros(allocator.num_pages + 1, dtype=torch.int32)
        # Rows whose first n positions are shared pages whose table entries are not written yet: row -> n.
        self._unwritten: dict[int, int] = {}
        self.prefix_cache: RadixCache | None = None

    @property
    def page_size(self) -> int:
        """Slots per page."""
        return self._page_size

    @property
    def free_pages(self) -> int:
        """Pages new tokens can take: free ones, and cached ones no request uses (evicted on demand)."""
        cache = self.prefix_cache
        return self.allocator.free_count + (cache.evictable_pages if cache is not None else 0)

    @property
    def free_tokens(self) -> int:
        """Slots in `free_pages` (the tail of a request's last partial page is not counted)."""
        return self.free_pages * self._page_size

    def attach_cache(self, cache: RadixCache | None) -> None:
        """Use `cache` to keep finished requests' pages (None: none); a cache attached before is flushed."""
        if self.prefix_cache is not None and self.prefix_cache is not cache:
            self.prefix_cache.flush()
        self.prefix_cache = cache

    @property
    def total_tokens(self) -> int:
        """Usable slots of the pool (the padding page excluded)."""
        return self.allocator.num_pages * self._page_size

    def new_request(self) -> int | None:
        """A request row holding no tokens yet, or None when every row is taken."""
        row = self.req_to_token.alloc()
        if row is None:
            return None
        self._pages[row] = []
        self._num_tokens[row] = 0
        return row

    def share_prefix(self, row: int, pages: Sequence[int]) -> None:
        """Start a new row with `pages` that the prefix cache holds (its first len(pages) * page_size tokens)."""
        if self._live_pages(row) or self._num_tokens[row]:
            raise ValueError(f"request row {row} already holds tokens: share a prefix only into a new row")
        if not pages:
            return
        self.retain(pages)
        self._pages[row] = list(pages)
        self._num_tokens[row] = self._unwritten[row] = len(pages) * self._page_size

    def retain(self, pages: Sequence[int]) -> None:
        """One more holder for each of `pages` (distinct pages that are in use)."""
        index = torch.as_tensor(pages, dtype=torch.int64)
        refs = self._refs[index]
        if bool((refs <= 0).any()):
            raise ValueError(f"cannot share page {int(index[refs <= 0][0])}: it is free")
        self._refs[index] = refs + 1

    def drop(self, pages: Sequence[int]) -> None:
        """One holder fewer for each of `pages` (distinct); pages nobody holds any more are freed."""
        index = torch.as_tensor(pages, dtype=torch.int64)
        if index.numel() == 0:
            return
        refs = self._refs[index]
        if bool((refs <= 0).any()):
            raise ValueError(f"double free: page {int(index[refs <= 0][0])} is not held")
        refs -= 1
        self._refs[index] = refs
        self.allocator.free(index[refs == 0])

    def refcounts(self, pages: Sequence[int]) -> list[int]:
        """How many holders each page has (0: free)."""
        return self._refs[torch.as_tensor(pages, dtype=torch.int64)].tolist()

    def pages_of(self, row: int) -> list[int]:
        """The page ids of a live request, in position order (a copy)."""
        return list(self._live_pages(row))

    def num_tokens_of(self, row: int) -> int:
        """How many token slots a live request holds."""
        self._live_pages(row)
        return self._num_tokens[row]

    def pages_needed(self, rows: Sequence[int], starts: Sequence[int], ends: Sequence[int]) -> int:
        """How many free pages `alloc_tokens(rows, starts, ends)` would take."""
        return sum(self._new_page_counts(*self._check_batch(rows, starts, ends)))

    def alloc_tokens(self, rows: Sequence[int], starts: Sequence[int], ends: Sequence[int]) -> torch.Tensor | None:
        """Slots for positions [starts[i], ends[i]) of each request, concatenated (an int64 CPU tensor).

        starts[i] must be the number of tokens request i already holds. The tail of its last partial page is
        filled first, then new pages (evicting unused cached pages when the free ones run short). The slots are
        also written into `req_to_token.table`. All or nothing: None, and no request changed, when the pages do not
        suffice.
        """
        step = self.alloc_step(rows, starts, ends)
        return None if step is None else step.out_cache_loc

    def alloc_step(self, rows: Sequence[int], starts: Sequence[int], ends: Sequence[int]) -> StepSlots | None:
        """`alloc_tokens`, also writing (and returning) the table entries of prefixes shared into these rows."""
        rows, starts, ends = self._check_batch(rows, starts, ends)
        counts = self._new_page_counts(rows, starts, ends)
        needed = sum(counts)
        if needed > self.allocator.free_count:
            if needed > self.free_pages:
                return None
            self.prefix_cache.evict(needed - self.allocator.free_count)
        new_pages = self.allocator.alloc(needed)
        if new_pages is None:
            return None
        self._refs[new_pages] = 1
        new_pages_list = new_pages.tolist()
        ps = self._page_size
        taken = 0
        for row, end, count in zip(rows, ends, counts, strict=True):
            self._pages[row].extend(new_pages_list[taken : taken + count])
            taken += count
            self._num_tokens[row] = end

        prefix = self._take_unwritten(rows) if self._unwritten else None
        if all(end - start == 1 for start, end in zip(starts, ends, strict=True)):
            # A decode step (one token per request): its slots in plain Python, a few list reads per request,
            # instead of a dozen small tensor ops on the host each step.
            pages = self._pages
            slot_list = [pages[row][start // ps] * ps + start % ps for row, start in zip(rows, starts, strict=True)]
            index = torch.tensor([rows, starts, slot_list], dtype=torch.int64)
            self._write_table(index if prefix is None else torch.cat([prefix, index], 1))
            return StepSlots(index[2], prefix, index[1])
        lengths = torch.tensor(ends, dtype=torch.int64) - torch.tensor(starts, dtype=torch.int64)
        num_new = int(lengths.sum()) if lengths.numel() else 0
        if num_new == 0:
            if prefix is not None:
                self._write_table(prefix)
            empty = torch.empty(0, dtype=torch.int64)
            return StepSlots(empty, prefix, empty)
        # The pages each request's new positions fall in, concatenated over the batch.
        batch_pages: list[int] = []
        first_page_index: list[int] = []  # where request i's pages begin in batch_pages
        for row, start, end in zip(rows, starts, ends, strict=True):
            first_page_index.append(len(batch_pages))
            if end > start:
                batch_pages.extend(self._pages[row][start // ps : (end - 1) // ps + 1])
        starts_t = torch.tensor(starts, dtype=torch.int64)
        req = torch.repeat_interleave(torch.arange(len(rows)), lengths)  # request index of each new position
        offsets = torch.cumsum(lengths, 0) - lengths  # first new position of each request in the batch
        positions = torch.arange(num_new) - offsets[req] + starts_t[req]
        page_index = torch.tensor(first_page_index, dtype=torch.int64)[req] + positions // ps - (starts_t // ps)[req]
        slots = torch.tensor(batch_pages, dtype=torch.int64)[page_index] * ps + positions % ps

        # One host-to-device copy and one indexed write for the whole batch (shared prefixes included).
        index = torch.stack([torch.tensor(rows, dtype=torch.int64)[req], positions, slots])
        self._write_table(index if prefix is None else torch.cat([prefix, index], 1))
        return StepSlots(slots, prefix, positions)

    def _write_table(self, index: torch.Tensor) -> None:
        index = index.to(self.req_to_token.device, non_blocking=True)
        self.req_to_token.table[index[0], index[1]] = index[2].to(torch.int32)

    def _take_unwritten(self, rows: list[int]) -> torch.Tensor | None:
        """The table entries of the shared prefixes of `rows` not written yet ([3, n]), now in hand."""
        ps, parts = self._page_size, []
        for row in rows:
            n = self._unwritten.pop(row, 0)
            if n:
                pages = torch.tensor(self._pages[row][: n // ps], dtype=torch.int64)
                slots = (pages[:, None] * ps + torch.arange(ps)).reshape(-1)
                parts.append(torch.stack([torch.full((n,), row, dtype=torch.int64), torch.arange(n), slots]))
        return torch.cat(parts, 1) if parts else None

    def release(self, row: int) -> None:
        """Free every page of a request and its row."""
        pages = self._live_pages(row)
        self.drop(pages)
        self._pages[row] = None
        self._num_tokens[row] = 0
        self._unwritten.pop(row, None)
        self.req_to_token.free(row)

    def release_all(self) -> None:
        """Free every live request and empty the prefix cache (after a failed step, when no request can go on and
        the K/V that step wrote cannot be trusted)."""
        for row, pages in enumerate(self._pages):
            if pages is not None:
                self.release(row)
        if self.prefix_cache is not None:
            self.prefix_cache.flush()

    def _live_pages(self, row: int) -> list[int]:
        pages = self._pages[row] if 0 <= row < len(self._pages) else None
        if pages is None:
            raise ValueError(f"request row {row} is not live: get one from new_request()")
        return pages

    def _check_batch(
        self, rows: Sequence[int], starts: Sequence[int], ends: Sequence[int]
    ) -> tuple[list[int], list[int], list[int]]:
        rows, starts, ends = [int(r) for r in rows], [int(s) for s in starts], [int(e) for e in ends]
        if not len(rows) == len(starts) == len(ends):
            raise ValueError(f"rows, starts and ends differ in length: {len(rows)}, {len(starts)}, {len(ends)}")
        if len(set(rows)) != len(rows):
            raise ValueError(f"a request row appears twice in one batch: {rows}")
        max_len = self.req_to_token.max_context_len
        for row, start, end in zip(rows, starts, ends, strict=True):
            self._live_pages(row)
            if start != self._num_tokens[row]:
                raise ValueError(f"request row {row} holds {self._num_tokens[row]} tokens, but start is {start}")
            if not start <= end <= max_len:
                raise ValueError(f"request row {row}: end {end} must be in [{start}, {max_len}] (the context length)")
        return rows, starts, ends

    def _new_page_counts(self, rows: list[int], starts: list[int], ends: list[int]) -> list[int]:
        ps = self._page_size
        return [max(0, -(-end // ps) - len(self._pages[row])) for row, end in zip(rows, ends, strict=True)]
