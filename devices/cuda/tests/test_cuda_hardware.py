"""CudaPlatform on a real NVIDIA GPU; skipped, with the probe's reason, wherever none is visible."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from omnirun.devices.cuda.platform import CudaPlatform

pytestmark = pytest.mark.device("cuda")

MiB = 1 << 20


@pytest.fixture(scope="module")
def cuda() -> CudaPlatform:
    return CudaPlatform()


def test_probe_finds_the_gpus_without_initialising_cuda():
    # A fresh process: this one has initialised CUDA already, or will.
    code = (
        "import torch\n"
        "from omnirun.devices.cuda.platform import CudaPlatform\n"
        "probe = CudaPlatform().probe()\n"
        "print(probe.available, probe.device_count, torch.cuda.is_initialized())\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["True", str(torch.cuda.device_count()), "False"]


def test_memory_info_reports_free_within_total(cuda: CudaPlatform):
    free, total = cuda.memory_info()
    assert 0 < free <= total


def test_peak_memory_grows_with_an_allocation_and_resets(cuda: CudaPlatform):
    cuda.reset_peak_memory()
    before = cuda.peak_memory_allocated()
    block = torch.empty(64 * MiB, dtype=torch.uint8, device=cuda.device())
    assert cuda.peak_memory_allocated() >= before + 64 * MiB
    del block
    cuda.reset_peak_memory()
    assert cuda.peak_memory_allocated() < before + 64 * MiB


def test_capabilities_match_the_gpu(cuda: CudaPlatform):
    caps = cuda.capabilities
    sm = torch.cuda.get_device_capability()
    assert caps.device_name == torch.cuda.get_device_name()
    assert caps.graph_capture == "cuda_graph"
    assert caps.bf16 is (sm >= (8, 0))  # H200 (sm90): True
    assert caps.fp8_e4m3_dtype is (torch.float8_e4m3fn if sm >= (8, 9) else None)  # sm90: e4m3fn
    # Every advertised dtype really computes and converts on this GPU.
    ones = torch.ones(16, device=cuda.device())
    for dtype in caps.model_dtypes:
        assert (ones.to(dtype) * 2).sum().item() == 32
    for dtype in caps.kv_cache_dtypes:
        assert torch.equal(ones.to(dtype).float(), ones)


def test_set_device_and_seed_are_honoured(cuda: CudaPlatform):
    cuda.set_device(0)
    assert cuda.current_device() == 0
    cuda.manual_seed(1234)
    first = torch.randn(8, device=cuda.device())
    cuda.manual_seed(1234)
    assert torch.equal(torch.randn(8, device=cuda.device()), first)


def test_events_time_work_on_a_platform_stream(cuda: CudaPlatform):
    stream = cuda.stream()
    assert stream.device == cuda.device()
    start, end = cuda.event(enable_timing=True), cuda.event(enable_timing=True)
    a = torch.randn(2048, 2048, device=cuda.device())
    cuda.synchronize()
    with torch.cuda.stream(stream):
        start.record(stream)
        b = a @ a
        end.record(stream)
    end.synchronize()
    assert start.elapsed_time(end) > 0
    cuda.synchronize()
    assert b.shape == (2048, 2048)
