"""PageAllocator: property tests over random alloc/free sequences, and the errors a bad free raises."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from omnirun.memory import PageAllocator


class AllocatorMachine(RuleBasedStateMachine):
    """Drives one allocator with random allocs and frees, checked against a plain Python model."""

    @initialize(num_pages=st.integers(0, 40), page_size=st.sampled_from([1, 4, 16]))
    def setup(self, num_pages: int, page_size: int) -> None:
        self.alloc_ = PageAllocator(num_pages, page_size)
        self.num_pages = num_pages
        self.page_size = page_size
        self.held: set[int] = set()

    @rule(n=st.integers(0, 50))
    def alloc(self, n: int) -> None:
        free_before = self.alloc_.free_count
        pages = self.alloc_.alloc(n)
        if n > free_before:
            assert pages is None
            assert self.alloc_.free_count == free_before
            return
        assert pages is not None
        assert pages.dtype == torch.int64 and pages.device.type == "cpu" and pages.shape == (n,)
        got = pages.tolist()
        assert len(set(got)) == n, "a page was handed out twice in one call"
        assert all(1 <= p <= self.num_pages for p in got), "page 0 or an out-of-range id was handed out"
        assert not (set(got) & self.held), "a page still allocated was handed out again"
        self.held |= set(got)

    @precondition(lambda self: self.held)
    @rule(data=st.data(), as_tensor=st.booleans())
    def free_some(self, data: st.DataObject, as_tensor: bool) -> None:
        chosen = data.draw(st.lists(st.sampled_from(sorted(self.held)), unique=True, min_size=1))
        self.alloc_.free(torch.tensor(chosen) if as_tensor else chosen)
        self.held -= set(chosen)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def double_free_is_refused_and_changes_nothing(self, data: st.DataObject) -> None:
        held = data.draw(st.sampled_from(sorted(self.held)))
        free_page = [p for p in range(1, self.num_pages + 1) if p not in self.held][:1]
        before = self.alloc_.free_count
        # Either a page that is already free, or the same page twice in one call.
        bad = [held] + free_page if free_page else [held, held]
        with pytest.raises(ValueError, match="double free"):
            self.alloc_.free(bad)
        assert self.alloc_.free_count == before

    @rule()
    def reset(self) -> None:
        self.alloc_.reset()
        self.held.clear()

    @invariant()
    def counts_are_consistent(self) -> None:
        assert self.alloc_.free_count == self.num_pages - len(self.held)
        assert self.alloc_.free_tokens == self.alloc_.free_count * self.page_size

    def teardown(self) -> None:
        # Freeing everything brings the allocator back to where it started.
        if hasattr(self, "alloc_"):
            self.alloc_.free(sorted(self.held))
            assert self.alloc_.free_count == self.num_pages
            everything = self.alloc_.alloc(self.num_pages)
            assert sorted(everything.tolist()) == list(range(1, self.num_pages + 1))


AllocatorMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestAllocatorProperties = AllocatorMachine.TestCase


def test_alloc_zero_gives_empty_tensor():
    allocator = PageAllocator(4, 16)
    pages = allocator.alloc(0)
    assert pages is not None and pages.numel() == 0 and pages.dtype == torch.int64
    assert allocator.free_count == 4


def test_alloc_too_many_returns_none_and_changes_nothing():
    allocator = PageAllocator(3, 2)
    assert allocator.alloc(2).tolist() == [1, 2]
    assert allocator.alloc(2) is None
    assert allocator.free_count == 1 and allocator.free_tokens == 2
    assert allocator.alloc(1).tolist() == [3]


def test_returned_tensor_does_not_alias_internal_state():
    allocator = PageAllocator(4, 1)
    pages = allocator.alloc(2)
    pages.fill_(0)
    allocator.free([1, 2])
    assert allocator.free_count == 4


@pytest.mark.parametrize(
    ("pages", "match"),
    [
        ([0], "page 0 is the reserved padding page"),
        ([5], r"valid ids are 1\.\.4"),
        ([-1], r"valid ids are 1\.\.4"),
        ([3], "double free: page 3 is not allocated"),
        ([1, 1], "double free: page 1 appears more than once"),
    ],
)
def test_bad_free_raises_and_frees_nothing(pages, match):
    allocator = PageAllocator(4, 8)
    allocator.alloc(2)  # pages 1 and 2
    with pytest.raises(ValueError, match=match):
        allocator.free(pages)
    assert allocator.free_count == 2


def test_free_rejects_float_ids():
    allocator = PageAllocator(4, 1)
    allocator.alloc(1)
    with pytest.raises(ValueError, match="integers"):
        allocator.free(torch.tensor([1.0]))


def test_free_accepts_empty_and_reset_frees_all():
    allocator = PageAllocator(5, 1)
    allocator.free([])
    allocator.alloc(5)
    assert allocator.free_count == 0
    allocator.reset()
    assert allocator.free_count == 5
    assert allocator.alloc(5).tolist() == [1, 2, 3, 4, 5]
