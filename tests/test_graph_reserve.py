"""The memory a platform's graph runner reserves comes out of the KV pool, on the CPU with a stand-in graph runner
and a fixed memory probe (devices/cuda/tests/test_cuda_graph_reserve.py checks the real one on a GPU)."""

from __future__ import annotations

import pytest

from omnirun.devices.cpu.platform import CpuPlatform
from omnirun.testing import make_runner, tiny_configs, tiny_hf_model

MIB = 1 << 20
RESERVE = 3 * MIB
PAGE = 16


class FakeGraphRunner:
    def __init__(self, runner, log: list):
        self.runner, self.log = runner, log

    def reserved_bytes(self) -> int:
        self.log.append("reserved_bytes")
        return RESERVE

    def capture(self, progress: bool = True) -> None:
        self.log.append(("capture", self.runner.kv.total_tokens))  # the pool exists by now

    def can_run(self, batch) -> bool:
        return False


class GraphCpuPlatform(CpuPlatform):
    """The host CPU with a fixed memory probe (the host's own moves between runs) and a graph runner."""

    def __init__(self):
        super().__init__()
        self.log: list = []

    def memory_info(self, index=None):
        return 48 * MIB, 64 * MIB

    def make_graph_runner(self, runner):
        self.log.append("make_graph_runner")
        return FakeGraphRunner(runner, self.log)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    tiny_hf_model("llama").save_pretrained(path)
    return path


def _runner(checkpoint, platform, **flags):
    # 0.5 of 64 MiB is static: 16 MiB of the 48 free go to the KV pool, less the reserve. A token cap above that,
    # so that memory, not what 4 running requests can fill, sizes the pool.
    flags = dict(max_total_tokens=1 << 40, mem_fraction_static=0.5, page_size=PAGE, max_running_requests=4, **flags)
    return make_runner(platform, checkpoint, **flags)


def test_the_graph_reserve_shrinks_the_kv_pool_by_its_size(checkpoint):
    config = tiny_configs()["llama"]
    head_dim = config.hidden_size // config.num_attention_heads
    kv_bytes_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 4  # K and V, fp32

    eager_platform, graph_platform = GraphCpuPlatform(), GraphCpuPlatform()
    eager = _runner(checkpoint, eager_platform, disable_graph=True)
    graphs = _runner(checkpoint, graph_platform)
    assert eager.graph_runner is None and eager_platform.log == []
    assert isinstance(graphs.graph_runner, FakeGraphRunner)

    shrunk = eager.kv.total_tokens - graphs.kv.total_tokens
    assert abs(shrunk - RESERVE // kv_bytes_per_token) < PAGE  # whole pages either side
    # the runner asked for the reserve before sizing the pool, and captured once, after it existed
    assert graph_platform.log == ["make_graph_runner", "reserved_bytes", ("capture", graphs.kv.total_tokens)]
