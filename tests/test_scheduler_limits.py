"""Scheduler limits: the length limit counts tokens still on the device, and
prompt chunks that end inside a page take only the pages they newly touch."""

from __future__ import annotations

import torch

from omnirun.batch import ForwardMode
from omnirun.engine.request import Request
from omnirun.engine.scheduler import Scheduler
from omnirun.memory import KVMemory, PageAllocator, PagedKVCache, ReqToTokenPool
from omnirun.sampling import SamplingParams

CPU = torch.device("cpu")
CONTEXT = 64


def _scheduler(num_pages: int, page: int, *, chunk: int = 64, budget: int = 64) -> Scheduler:
    kv = KVMemory(
        PageAllocator(num_pages, page),
        ReqToTokenPool(4, CONTEXT, CPU),
        PagedKVCache(1, (num_pages + 1) * page, 1, 4, torch.float32, CPU, page_size=page),
        page,
    )
    return Scheduler(
        kv,
        CPU,
        max_running_requests=4,
        max_prefill_tokens=budget,
        chunked_prefill_size=chunk,
        context_length=CONTEXT,
    )


def _step(scheduler: Scheduler):
    step = scheduler.schedule()
    assert step is not None
    for i in step.sampling:
        step.requests[i].output_ids.append(7)
    return step


def _token_on_the_device(req: Request) -> None:
    """The last sampled token has not reached the host yet (overlap scheduling)."""
    req.output_ids.pop()
    req.num_pending = 1


def test_a_pending_token_that_reaches_max_new_tokens_is_not_decoded_past():
    s = _scheduler(60, 1)
    req = Request(0, [1, 2, 3], SamplingParams(max_new_tokens=2))
    s.add(req)
    _step(s)  # prefill: output token 1
    _step(s)  # decode: output token 2, the last one
    _token_on_the_device(req)  # one output on the host + one on the device = max_new_tokens
    assert s.schedule() is None  # (the engine finishes the request once the token arrives)
    assert s.running == [req] and s.num_preemptions == 0


def test_a_pending_token_that_reaches_the_context_length_is_not_decoded_past():
    s = _scheduler(70, 1)
    req = Request(0, list(range(1, CONTEXT - 1)), SamplingParams(max_new_tokens=None))
    s.add(req)
    _step(s)  # prefill of 62 tokens: output token 1 (63 tokens)
    _step(s)  # decode: 64 tokens, the context length
    _token_on_the_device(req)
    assert req.num_tokens == CONTEXT - 1 and s.schedule() is None
    assert s.running == [req] and s.num_preemptions == 0


def test_chunks_ending_inside_a_page_take_only_the_pages_they_newly_touch():
    page = 4
    s = _scheduler(4, page, chunk=6)  # 16 slots
    req = Request(0, list(range(1, 15)), SamplingParams(max_new_tokens=2))  # 14 tokens: pages 1-4
    s.add(req)
    sizes, free_pages = [], []
    for _ in range(3):
        step = _step(s)
        assert step.batch.mode is ForwardMode.EXTEND
        sizes.append(step.batch.num_tokens)
        free_pages.append(s.kv.allocator.free_count)
    # 6 tokens: pages 1-2; then 6..11: page 3 only (page 2 has room for 6, 7); then 12, 13: page 4
    assert sizes == [6, 6, 2] and free_pages == [2, 1, 0]
    step = _step(s)  # token 15 goes into the last page's free slot: no preemption
    assert step.batch.mode is ForwardMode.DECODE and s.num_preemptions == 0


def test_a_chunk_that_starts_inside_a_page_fits_in_one_free_page():
    page = 4
    s = _scheduler(3, page, chunk=6, budget=64)  # 12 slots
    req = Request(0, list(range(1, 11)), SamplingParams(max_new_tokens=2))  # 10 tokens: 3 pages
    s.add(req)
    assert _step(s).batch.num_tokens == 6  # tokens 0-5: pages 1-2, 1 page free
    step = _step(s)  # tokens 6-9: 2 in page 2, 2 in page 3 - one new page, which is what is free
    assert step.batch.mode is ForwardMode.EXTEND and step.batch.num_tokens == 4
    assert s.num_preemptions == 0 and req.num_cached == 10


def test_headroom_is_one_decode_token_per_decoding_request_not_per_midway_prompt():
    s = _scheduler(14, 1, chunk=6)
    a = Request(0, list(range(1, 11)), SamplingParams(max_new_tokens=4))
    s.add(a)
    assert _step(s).batch.num_tokens == 6  # A alone, first chunk: 8 free
    b = Request(1, [1, 2], SamplingParams(max_new_tokens=4))
    s.add(b)
    # A's last 4 tokens, B's 2, and a decode token each afterwards: 8 = what is free (A is mid-way, not decoding,
    # so it needs no headroom of its own beyond the one it gets as a request of this step)
    step = _step(s)
    assert [r.request_id for r in step.requests] == [0, 1] and step.batch.num_tokens == 6
    step = _step(s)
    assert step.batch.mode is ForwardMode.DECODE and len(step.requests) == 2 and s.num_preemptions == 0


def test_batches_are_built_on_the_schedulers_device():
    """On the meta device (any host), so that a batch left on the default device shows."""
    s = Scheduler(
        _scheduler(20, 1).kv,
        torch.device("meta"),
        max_running_requests=4,
        max_prefill_tokens=64,
        chunked_prefill_size=64,
        context_length=CONTEXT,
    )
    s.add(Request(0, [1, 2, 3], SamplingParams(max_new_tokens=4)))
    step = _step(s)
    assert step.batch.mode is ForwardMode.EXTEND and step.batch.input_ids.device.type == "meta"
    step = _step(s)
    assert step.batch.mode is ForwardMode.DECODE and step.batch.input_ids.device.type == "meta"
