"""On a real GPU, the KV pool with CUDA graphs is smaller than with --disable-graph by about the graph reserve."""

from __future__ import annotations

import gc

import pytest
import torch

from omnirun.devices.cuda.platform import CudaPlatform
from omnirun.testing import make_runner, tiny_configs, tiny_hf_model

pytestmark = pytest.mark.device("cuda")

GIB = 1 << 30


@pytest.fixture(scope="module")
def tiny_bf16(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-bf16")
    tiny_hf_model("llama", dtype=torch.bfloat16).save_pretrained(path)
    return path


def _pool(platform, path, fraction, **flags):
    # A --max-total-tokens far above memory: the pool is memory's alone (the default cap, running limit x context
    # length, holds a tiny model's pools to one size with or without the reserve).
    runner = make_runner(platform, path, dtype="auto", max_total_tokens=1 << 40, mem_fraction_static=fraction, **flags)
    tokens, reserve = runner.kv.total_tokens, runner.graph_runner.reserved_bytes() if runner.graph_runner else 0
    del runner
    gc.collect()
    platform.empty_cache()
    return tokens, reserve


def test_graph_reserve_shrinks_the_kv_pool(tiny_bf16):
    cuda = CudaPlatform()
    free, total = cuda.memory_info()
    # A static share that leaves about 4 GiB of KV budget, so the test does not fill the GPU.
    fraction = 1 - (free - 4 * GIB) / total
    config = tiny_configs()["llama"]
    head_dim = config.hidden_size // config.num_attention_heads
    kv_bytes_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 2  # K and V, bf16

    eager_tokens, _ = _pool(cuda, tiny_bf16, fraction, disable_graph=True)
    graph_tokens, reserve = _pool(cuda, tiny_bf16, fraction)
    assert reserve > 0
    shrunk_bytes = (eager_tokens - graph_tokens) * kv_bytes_per_token
    # The two start-ups see free memory within a few MiB of each other (the allocator's and the context's noise).
    assert abs(shrunk_bytes - reserve) < 0.05 * reserve + 64 * (1 << 20), (shrunk_bytes, reserve)
