"""`omnirun bench`'s numbers against values worked out here: the bandwidth from a fake clock, the bytes of a decode
step from the preset's config, and throughput and latencies from their definitions."""

from __future__ import annotations

import itertools

import pytest

from omnirun import bandwidth as bandwidth_module
from omnirun import bench
from omnirun.bandwidth import Bandwidth, measure_bandwidth
from omnirun.devices.cpu.platform import CpuPlatform
from omnirun.engine import LLM

MIB = 1 << 20


def test_bandwidth_counts_read_and_write_bytes_of_a_copy(monkeypatch):
    ticks = itertools.count(step=0.25)  # every timed call takes 0.25 s on this clock
    monkeypatch.setattr(bandwidth_module.time, "perf_counter", lambda: next(ticks))
    result = measure_bandwidth(CpuPlatform(), CpuPlatform().device(), nbytes=4 * MIB, repeats=3)
    assert result.copy_bytes_per_s == 2 * 4 * MIB / 0.25  # a copy reads and writes every byte
    assert result.read_bytes_per_s == 4 * MIB / 0.25
    assert result.as_dict() == {"copy_GBps": 2 * 4 * MIB / 0.25 / 1e9, "read_GBps": 4 * MIB / 0.25 / 1e9}


@pytest.fixture(scope="module")
def result():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bench, "measure_bandwidth", lambda platform, device: Bandwidth(2e9, 1e9))
        llm = LLM("tiny-llama", load_format="dummy", device="cpu", dtype="float32", max_total_tokens=2048)
        return bench.run_bench(llm, batch_size=3, input_len=8, output_len=6, num_prompts=3, warmup=False)


def test_weight_bytes_of_a_decode_step_are_every_weight_but_the_embedding(result):
    # tiny-llama: hidden 64, intermediate 128, 2 layers, 4 heads and 2 KV heads of 16, vocab 512, untied, float32
    hidden, inter, layers, q, kv, vocab = 64, 128, 2, 4 * 16, 2 * 16, 512
    per_layer = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * inter + 2 * hidden  # qkv, o, mlp, two norms
    weights = (layers * per_layer + hidden + vocab * hidden) * 4  # + the final norm and the LM head
    assert result["weight_bytes_per_step"] == weights


def test_kv_bytes_of_a_decode_step_are_the_batch_s_cached_tokens(result):
    kv_bytes_per_token = 2 * 2 * 2 * 16 * 4  # K and V, 2 layers, 2 KV heads of 16, float32
    kv_tokens = (result["decode_step_bytes"] - result["weight_bytes_per_step"]) / kv_bytes_per_token
    # three requests decode tokens 2..6 together: at step j (1..5) each holds 8 + j tokens, and the median of the
    # timed steps (which ones the engine times is its business) is one of them or halfway between two
    assert 2 * (kv_tokens / 3 - 8) in range(2, 11)


def test_roofline_is_the_step_s_bytes_over_its_time_over_the_bandwidth(result):
    step_s = result["decode_step_ms_median"] / 1e3
    assert result["copy_GBps"] == 2.0 and result["read_GBps"] == 1.0
    assert result["roofline_fraction_copy_bw"] == pytest.approx(result["decode_step_bytes"] / step_s / 2e9)
    assert result["roofline_fraction_read_bw"] == pytest.approx(result["decode_step_bytes"] / step_s / 1e9)


def test_throughput_and_latencies_follow_their_definitions(result):
    assert result["output_tokens_per_s"] == pytest.approx(3 * 6 / result["total_s"])
    ttft, tpot = result["ttft_ms_mean"], result["tpot_ms_mean"]
    assert 0 < ttft and 0 < tpot
    # a request's latency is its first token plus (n - 1) later ones, and no request outlasts the run
    assert ttft + 5 * tpot <= result["total_s"] * 1e3
    assert result["preemptions"] == 0
