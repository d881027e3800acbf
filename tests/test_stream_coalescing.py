"""A server reader that falls behind the engine joins the deltas that piled up: one message per request, not one
per token, with nothing lost or reordered."""

from __future__ import annotations

import asyncio

import pytest

from omnirun.engine import StreamDelta
from omnirun.server.async_engine import AsyncChannel, Mailbox, _coalesced


def test_then_joins_tokens_text_and_logprobs_in_order():
    first = StreamDelta(7, [1, 2], "ab", None, [-0.1, -0.2], [[(1, -0.1)], [(2, -0.2)]])
    second = StreamDelta(7, [3], "c", "stop", [-0.3], [[(3, -0.3)]])
    joined = first.then(second)
    assert joined == StreamDelta(
        7, [1, 2, 3], "abc", "stop", [-0.1, -0.2, -0.3], [[(1, -0.1)], [(2, -0.2)], [(3, -0.3)]]
    )
    untokenized = StreamDelta(7, [1], None, None).then(StreamDelta(7, [2], None, "length"))
    assert untokenized.text is None and untokenized.logprobs is None and untokenized.top_logprobs is None


def test_coalesced_keeps_each_request_apart_and_raises_an_engine_error():
    items = [
        (1, StreamDelta(1, [5], "x", None)),
        (2, StreamDelta(2, [6], "y", None)),
        (1, StreamDelta(1, [7], "z", "stop")),
    ]
    merged = _coalesced(items)
    assert list(merged) == [1, 2]
    assert merged[1] == StreamDelta(1, [5, 7], "xz", "stop") and merged[2] == StreamDelta(2, [6], "y", None)
    with pytest.raises(RuntimeError, match="boom"):
        _coalesced([*items, (1, RuntimeError("boom"))])


def test_a_reader_behind_takes_every_queued_item_at_once():
    async def scenario() -> tuple[list, list]:
        channel = AsyncChannel(Mailbox(asyncio.get_running_loop()))
        for token in range(3):
            channel.put((1, StreamDelta(1, [token], None, None)))
        await asyncio.sleep(0)  # the mailbox delivers on the next loop iteration
        behind = await channel.get_all(timeout=1)
        with pytest.raises(asyncio.TimeoutError):
            await channel.get_all(timeout=0.01)
        channel.put((1, StreamDelta(1, [9], None, "stop")))
        return behind, await channel.get_all(timeout=1)

    behind, last = asyncio.run(scenario())
    assert [item[1].token_ids for item in behind] == [[0], [1], [2]]
    assert [item[1].token_ids for item in last] == [[9]]
