"""LLM lifecycle on a real GPU at a real shape: three Llama-3-8B-shaped LLMs (dummy weights, CUDA graphs) one
after another in one process, each closed, each sizing the same KV pool from the memory the last one gave back."""

from __future__ import annotations

import gc

import pytest
import torch

from omnirun.engine import LLM
from omnirun.sampling import SamplingParams

pytestmark = pytest.mark.device("cuda")


def test_three_8b_llms_in_a_row_size_the_same_kv_pool():
    gc.collect()
    torch.cuda.empty_cache()
    free_at_start = torch.cuda.mem_get_info()[0]
    pools, tokens = [], []
    params = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    for _ in range(3):
        with LLM("llama-3-8b", load_format="dummy", device="cuda", progress=False) as llm:
            assert llm.runner.graph_runner is not None and llm.runner.graph_runner.graphs
            pools.append(llm.runner.kv.total_tokens)
            tokens.append(llm.generate([[1, 2, 3, 4]], params, use_tqdm=False)[0].token_ids)
        free_after = torch.cuda.mem_get_info()[0]
        assert free_after > free_at_start - (1 << 30), f"{(free_at_start - free_after) / 2**30:.2f} GiB not given back"
    print("KV pool tokens of the three LLMs:", pools)
    # (lazily made workspaces of the first run — cuBLAS, Triton — may keep a few MiB: a handful of tokens)
    assert pools[0] > 100_000 and all(abs(p - pools[0]) <= 0.005 * pools[0] for p in pools), pools
    assert tokens == [tokens[0]] * 3
