"""Shared by the op benchmarks (`bench/moe_op.py`, `bench/fp8_linear.py`, `bench/int4_linear.py`): time a piece of
device work as a decode step runs it, replayed from a device graph, and the shapes of a decoder layer's matmuls."""

from __future__ import annotations


def graph_ms(platform, fn, repeats: int = 20) -> float:
    """Milliseconds per replay of a graph of `fn` (captured after a warm-up call that compiles it)."""
    api = platform.graph_api()
    fn()
    platform.synchronize()
    graph = api.new_graph()
    with api.capture(graph, pool=api.new_pool()):
        fn()
    graph.replay()
    start, end = platform.event(enable_timing=True), platform.event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    platform.synchronize()
    return start.elapsed_time(end) / repeats


def projections(shape) -> list[tuple[int, int]]:
    """(N, K) of a decoder layer's four matmuls: q|k|v, o, gate|up, down."""
    hd = shape.head_dim
    qkv = (shape.num_heads + 2 * shape.num_kv_heads) * hd
    return [
        (qkv, shape.hidden_size),
        (shape.hidden_size, shape.num_heads * hd),
        (2 * shape.intermediate_size, shape.hidden_size),
        (shape.hidden_size, shape.intermediate_size),
    ]
