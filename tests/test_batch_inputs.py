"""ForwardBatch.decode_inputs: a decode batch's int inputs as the one packed tensor a graph replay copies."""

from __future__ import annotations

import dataclasses

import torch

from omnirun.batch import build_batch
from omnirun.memory import KVMemory, PageAllocator, PagedKVCache, ReqToTokenPool

CPU = torch.device("cpu")


def memory() -> KVMemory:
    return KVMemory(PageAllocator(32, 1), ReqToTokenPool(4, 64, CPU), PagedKVCache(1, 33, 1, 4, torch.float32, CPU), 1)


def test_a_decode_batch_packs_its_inputs_in_the_graph_runners_row_order():
    kv = memory()
    rows = [kv.new_request(), kv.new_request()]
    kv.alloc_step(rows, [0, 0], [5, 3])  # prefixes of 5 and 3 tokens
    batch = build_batch(kv, rows, [5, 3], [[11], [12]], CPU)
    packed = batch.decode_inputs()
    assert packed.shape == (5, 2)
    want = [batch.input_ids, batch.positions, batch.out_cache_loc, batch.req_pool_indices, batch.seq_lens.long()]
    assert packed.tolist() == [t.tolist() for t in want]
    assert packed[0].tolist() == [11, 12] and packed[4].tolist() == [6, 4]
    # Written in place (as the engine fills pending tokens), the ids are still the packed row.
    torch.where(batch.input_ids == 11, torch.tensor(7), batch.input_ids, out=batch.input_ids)
    assert batch.decode_inputs()[0].tolist() == [7, 12]


def test_a_batch_whose_inputs_are_not_the_packed_views_has_none():
    kv = memory()
    rows = [kv.new_request()]
    batch = build_batch(kv, rows, [0], [[1]], CPU)
    assert batch.decode_inputs() is not None
    # A replaced field (out of place), a prefill, a batch built by hand: the packed copy would be stale or absent.
    assert dataclasses.replace(batch, input_ids=batch.input_ids + 1).decode_inputs() is None
    assert dataclasses.replace(batch, seq_lens=batch.seq_lens + 1).decode_inputs() is None  # row 4 would be stale
    assert dataclasses.replace(batch, device_ints=None).decode_inputs() is None
    assert build_batch(kv, rows, [1], [[2, 3]], CPU).decode_inputs() is None
