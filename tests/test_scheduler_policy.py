"""The scheduler's policy, checked on the Scheduler itself (outputs alone cannot show it: a preemption or a chunk
of another size gives the same tokens): which request is preempted, chunk and budget sizes, decode headroom when
admitting, the running-request cap. A page is one token here, so the arithmetic is the tokens'."""

from __future__ import annotations

import pytest
import torch

from omnirun.batch import ForwardMode
from omnirun.engine.request import Request
from omnirun.engine.scheduler import PENDING_TOKEN, Scheduler
from omnirun.memory import KVMemory, PageAllocator, PagedKVCache, ReqToTokenPool
from omnirun.sampling import SamplingParams

CPU = torch.device("cpu")
CONTEXT = 64


def _scheduler(pool_tokens: int, *, chunk: int = 64, budget: int = 64, max_running: int = 8) -> Scheduler:
    kv = KVMemory(
        PageAllocator(pool_tokens, 1),
        ReqToTokenPool(max_running, CONTEXT, CPU),
        PagedKVCache(1, pool_tokens + 1, 1, 4, torch.float32, CPU, page_size=1),
        1,
    )
    return Scheduler(
        kv,
        CPU,
        max_running_requests=max_running,
        max_prefill_tokens=budget,
        chunked_prefill_size=chunk,
        context_length=CONTEXT,
    )


def _request(request_id: int, prompt_len: int) -> Request:
    return Request(request_id, list(range(1, prompt_len + 1)), SamplingParams(max_new_tokens=CONTEXT))


def _step(scheduler: Scheduler):
    """One scheduled step, with a token sampled for every request whose sequence is now fully cached."""
    step = scheduler.schedule()
    assert step is not None
    for i in step.sampling:
        step.requests[i].output_ids.append(7)
    return step


def _ids(requests) -> list[int]:
    return [r.request_id for r in requests]


def test_a_decode_step_that_does_not_fit_preempts_the_newest_request():
    s = _scheduler(18)
    reqs = [_request(i, 5) for i in range(3)]
    for r in reqs:
        s.add(r)
    first = _step(s)
    assert first.batch.mode is ForwardMode.EXTEND and _ids(first.requests) == [0, 1, 2]  # 15 tokens, 3 free
    assert _ids(_step(s).requests) == [0, 1, 2]  # one decode token each: the pool is full
    step = _step(s)  # three more do not fit: the newest goes, and the others decode
    assert step.batch.mode is ForwardMode.DECODE and _ids(step.requests) == [0, 1]
    assert s.num_preemptions == 1 and reqs[2].num_preemptions == 1
    assert _ids(s.running) == [0, 1] and _ids(s.waiting) == [2]
    assert reqs[2].row is None and reqs[2].num_cached == 0  # its pages are back: recomputed when room returns
    assert s.kv.free_tokens == 18 - 2 * 7


def test_half_prefilled_prompts_that_block_each_other_preempt_the_newest():
    s = _scheduler(30, chunk=8, budget=24)
    a, b, c = _request(0, 15), _request(1, 15), _request(2, 15)
    for r in (a, b, c):
        s.add(r)
    first = _step(s)
    assert _ids(first.requests) == [0, 1, 2] and (a.num_cached, b.num_cached, c.num_cached) == (8, 8, 8)
    # 6 tokens free: no prompt's next chunk (7) fits and nobody decodes: C, started last, makes room for A and B
    step = _step(s)
    assert step.batch.mode is ForwardMode.EXTEND and _ids(step.requests) == [0, 1]
    assert a.num_cached == b.num_cached == 15
    assert c.num_preemptions == 1 and a.num_preemptions == b.num_preemptions == 0
    assert _ids(s.running) == [0, 1] and _ids(s.waiting) == [2] and c.row is None


def test_prompts_are_prefilled_in_chunks_of_the_chunked_prefill_size():
    s = _scheduler(60, chunk=8, budget=64)
    req = _request(0, 20)
    s.add(req)
    sizes, sampled = [], []
    for _ in range(3):
        step = _step(s)
        assert step.batch.mode is ForwardMode.EXTEND
        sizes.append(step.batch.num_tokens)
        sampled.append(step.sampling)
    assert sizes == [8, 8, 4]
    assert sampled == [[], [], [0]]  # only the last chunk yields a token
    assert req.output_ids == [7] and _step(s).batch.mode is ForwardMode.DECODE


def test_a_prefill_step_stays_within_the_token_budget():
    s = _scheduler(60, chunk=64, budget=12)
    a, b, c = _request(0, 10), _request(1, 10), _request(2, 3)
    for r in (a, b, c):
        s.add(r)
    step = _step(s)
    # A whole, then B's first 2 tokens; C waits for the next step
    assert _ids(step.requests) == [0, 1] and step.batch.num_tokens == 12
    assert (a.num_cached, b.num_cached, c.num_cached) == (10, 2, 0) and step.sampling == [0]
    assert _ids(s.waiting) == [2]
    step = _step(s)  # B's mid-way prompt goes first, then C
    assert _ids(step.requests) == [1, 2] and step.batch.num_tokens == 8 + 3


def test_a_new_request_is_admitted_only_with_a_decode_token_left_for_everyone():
    s = _scheduler(20)
    a = _request(0, 8)
    s.add(a)
    _step(s)  # A alone: 8 tokens cached, its first output token to decode; 12 free
    s.add(_request(1, 11))  # 11 fit, but then A and B could not both decode: B waits
    step = _step(s)
    assert step.batch.mode is ForwardMode.DECODE and _ids(step.requests) == [0]
    assert _ids(s.waiting) == [1]
    for _ in range(8):
        _step(s)
    assert s.num_preemptions == 0


def test_admission_takes_exactly_the_headroom_it_needs():
    s = _scheduler(20)
    s.add(_request(0, 8))
    _step(s)
    s.add(_request(1, 10))  # 10 + one decode token each for A and B = 12 = what is free
    step = _step(s)
    assert step.batch.mode is ForwardMode.EXTEND and _ids(step.requests) == [1]
    assert _ids(_step(s).requests) == [0, 1] and s.num_preemptions == 0  # and both decode


def test_headroom_counts_the_requests_admitted_in_the_same_step():
    s = _scheduler(20)
    s.add(_request(0, 8))
    _step(s)  # 12 free; A decodes
    s.add(_request(1, 5))
    s.add(_request(2, 5))  # B: 5 + 2 = 7 fits; B and C: 10 + 3 = 13 does not
    step = _step(s)
    assert _ids(step.requests) == [1] and _ids(s.waiting) == [2]


def test_the_first_request_goes_without_headroom():
    s = _scheduler(20)
    s.add(_request(0, 20))  # fills the pool; it alone always fits (the pool holds one context-length request)
    step = _step(s)
    assert _ids(step.requests) == [0] and step.batch.num_tokens == 20


def test_no_more_requests_run_than_the_cap():
    s = _scheduler(60, max_running=2)
    for i in range(3):
        s.add(_request(i, 4))
    assert _ids(_step(s).requests) == [0, 1]
    assert _ids(s.waiting) == [2]
    assert _ids(_step(s).requests) == [0, 1]  # decode; the third still waits
    s.finish(s.running[0])
    assert _ids(_step(s).requests) == [2]


def test_requests_admitted_together_into_an_idle_pool_leave_headroom_too():
    s = _scheduler(12)
    for i in range(2):
        s.add(_request(i, 6))  # A alone goes; A and B (12 tokens) would leave no decode token for either
    assert _ids(_step(s).requests) == [0]
    s = _scheduler(12)
    for i in range(2):
        s.add(_request(i, 5))  # 10 + one decode token each = 12
    assert _ids(_step(s).requests) == [0, 1]


def test_a_prefill_budget_of_one_token_still_takes_one():
    s = _scheduler(60, chunk=64, budget=11)
    s.add(_request(0, 10))
    s.add(_request(1, 10))
    step = _step(s)
    assert _ids(step.requests) == [0, 1] and step.batch.num_tokens == 11


def test_pages_are_counted_in_whole_pages():
    page = 4
    kv = KVMemory(
        PageAllocator(5, page),
        ReqToTokenPool(4, CONTEXT, CPU),
        PagedKVCache(1, 6 * page, 1, 4, torch.float32, CPU, page_size=page),
        page,
    )
    s = Scheduler(
        kv, CPU, max_running_requests=4, max_prefill_tokens=64, chunked_prefill_size=64, context_length=CONTEXT
    )
    s.add(_request(0, 9))  # 3 pages (2.25 if counted in fractions)
    s.add(_request(1, 2))  # 1 page, and a page of headroom for each decode: 6 pages > 5
    assert _ids(_step(s).requests) == [0] and kv.free_tokens == 2 * page


def test_a_decode_step_feeds_each_request_its_newest_token():
    s = _scheduler(60)
    a, b = _request(0, 3), _request(1, 5)
    s.add(a)
    s.add(b)
    _step(s)
    a.output_ids[-1], b.output_ids[-1] = 41, 42
    step = _step(s)
    assert step.batch.mode is ForwardMode.DECODE and step.batch.input_ids.tolist() == [41, 42]
    assert step.sampling == [0, 1] and not step.has_pending_inputs


def test_a_token_still_on_the_device_is_fed_as_pending():
    s = _scheduler(60)
    a, b = _request(0, 3), _request(1, 5)
    s.add(a)
    s.add(b)
    _step(s)
    _step(s)  # a decode step whose tokens the host has not read yet (overlap scheduling)
    a.output_ids.pop()
    a.num_pending = 1
    step = _step(s)
    assert step.batch.input_ids.tolist() == [PENDING_TOKEN, 7] and step.has_pending_inputs


def test_a_preempted_request_with_a_token_on_the_device_waits_for_it():
    s = _scheduler(8)
    a = _request(0, 8)
    s.add(a)
    _step(s)  # the pool is full
    a.output_ids.pop()
    a.num_pending = 1  # its first token is still on the device (overlap scheduling)
    s.add(_request(1, 8))
    # A's decode does not fit: A is preempted, but neither it nor B is scheduled (nor is it an error) until the
    # step in flight delivers A's token
    assert s.schedule() is None
    assert _ids(s.waiting) == [0, 1] and s.num_preemptions == 1


def test_a_request_larger_than_the_empty_pool_is_an_error_naming_it():
    s = _scheduler(8)
    s.add(_request(5, 9))
    with pytest.raises(RuntimeError, match="request 5 does not fit in an empty KV pool"):
        s.schedule()


def test_preemptions_are_counted_per_request_and_in_all():
    s = _scheduler(60)
    a, b = _request(0, 4), _request(1, 4)
    s.add(a)
    s.add(b)
    _step(s)
    for _ in range(2):
        s.preempt(b)
        _step(s)  # B is recomputed
    s.preempt(a)
    assert (a.num_preemptions, b.num_preemptions, s.num_preemptions) == (1, 2, 3)


def test_finishing_releases_the_row_or_leaves_the_queue():
    s = _scheduler(60)
    a, b = _request(0, 4), _request(1, 4)
    s.add(a)
    s.add(b)
    _step(s)
    s.preempt(b)
    s.finish(b)  # finished while queued for recompute
    assert _ids(s.waiting) == [] and b.row is None
    s.finish(a)
    assert a.row is None and s.running == [] and s.kv.free_tokens == 60 and not s.has_work
