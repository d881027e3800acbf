"""Hands out and takes back pages of the paged KV cache.

A page is `page_size` consecutive slots of the KV buffers. Page 0 is reserved as padding (never handed out), so
the usable page ids are 1..num_pages.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class PageAllocator:
    """A stack of free page ids plus an "allocated" mask; every call is O(pages moved), with no Python loop."""

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        # The free pages are _stack[:_count]; alloc pops from the top, free pushes onto it.
        self._stack = torch.empty(num_pages, dtype=torch.int64)
        self._allocated = torch.zeros(num_pages + 1, dtype=torch.bool)
        # Scratch for finding duplicates in O(n): each page writes its position, and a duplicate loses the write.
        self._scratch = torch.empty(num_pages + 1, dtype=torch.int64)
        self.reset()

    def reset(self) -> None:
        """Free every page."""
        # Descending, so the first alloc after a reset pops pages 1, 2, 3, ... (easy to read in logs and tests).
        torch.arange(self.num_pages, 0, -1, out=self._stack)
        self._count = self.num_pages
        self._allocated.zero_()

    @property
    def free_count(self) -> int:
        """Number of free pages."""
        return self._count

    @property
    def free_tokens(self) -> int:
        """Number of free slots (free pages times page size)."""
        return self._count * self.page_size

    def alloc(self, n: int) -> torch.Tensor | None:
        """`n` distinct free page ids as an int64 CPU tensor, or None (and nothing changed) when fewer are free."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({n})")
        if n > self._count:
            return None
        # flip() copies, so the caller's tensor never aliases the stack.
        pages = self._stack[self._count - n : self._count].flip(0)
        self._count -= n
        self._allocated[pages] = True
        return pages

    def free(self, pages: torch.Tensor | Sequence[int]) -> None:
        """Return pages to the free list. A bad id or a double free raises ValueError and frees nothing."""
        pages = self._as_page_tensor(pages)
        n = pages.numel()
        if n == 0:
            return
        lo, hi = int(pages.min()), int(pages.max())
        if lo < 1 or hi > self.num_pages:
            bad = lo if lo < 1 else hi
            reason = "page 0 is the reserved padding page" if bad == 0 else f"valid ids are 1..{self.num_pages}"
            raise ValueError(f"cannot free page {bad}: {reason}")
        not_allocated = ~self._allocated[pages]
        if bool(not_allocated.any()):
            bad = int(pages[not_allocated][0])
            raise ValueError(f"double free: page {bad} is not allocated")
        positions = torch.arange(n)
        self._scratch[pages] = positions
        duplicated = self._scratch[pages] != positions
        if bool(duplicated.any()):
            bad = int(pages[duplicated][0])
            raise ValueError(f"double free: page {bad} appears more than once in one free() call")
        self._allocated[pages] = False
        self._stack[self._count : self._count + n] = pages
        self._count += n

    @staticmethod
    def _as_page_tensor(pages: torch.Tensor | Sequence[int]) -> torch.Tensor:
        if isinstance(pages, torch.Tensor):
            if pages.dtype.is_floating_point or pages.dtype.is_complex or pages.dtype == torch.bool:
                raise ValueError(f"page ids must be integers, got a {pages.dtype} tensor")
            return pages.detach().to(device="cpu", dtype=torch.int64).reshape(-1)
        return torch.as_tensor(list(pages), dtype=torch.int64).reshape(-1)
