"""CudaPlatform against a stubbed torch.cuda: runs anywhere, no GPU needed.

The stubs follow torch's signatures: device_count(), get_device_capability(device=None), mem_get_info(device=None)...
"""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest
import torch

from omnirun.devices.cuda import platform as cuda_module
from omnirun.devices.cuda.platform import CudaPlatform
from omnirun.errors import DeviceUnavailableError

GiB = 1 << 30


@pytest.fixture
def fake_gpu(monkeypatch: pytest.MonkeyPatch) -> types.SimpleNamespace:
    """A CUDA build of torch seeing GPUs; a test sets count/capability/current and reads the recorded calls."""
    gpu = types.SimpleNamespace(count=2, capability=(9, 0), current=0, calls=[])

    def record(name, result=None):
        def call(device=None):
            gpu.calls.append((name, device))
            return result(device) if callable(result) else result

        return call

    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpu.count)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu.count > 0)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: gpu.current)
    monkeypatch.setattr(torch.cuda, "get_device_capability", record("get_device_capability", lambda d: gpu.capability))
    monkeypatch.setattr(torch.cuda, "get_device_name", record("get_device_name", lambda d: f"NVIDIA GPU {d}"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", record("mem_get_info", (3 * GiB, 8 * GiB)))
    monkeypatch.setattr(torch.cuda, "set_device", record("set_device"))
    monkeypatch.setattr(torch.cuda, "synchronize", record("synchronize"))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", record("max_memory_allocated", 5 * GiB))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", record("reset_peak_memory_stats"))
    monkeypatch.setattr(cuda_module, "triton_installed", lambda: True)
    return gpu


def test_identity():
    cuda = CudaPlatform()
    assert (cuda.name, cuda.torch_device_type, cuda.dispatch_key) == ("cuda", "cuda", "CUDA")
    assert cuda.visible_devices_env == "CUDA_VISIBLE_DEVICES"
    assert cuda.distributed_backend == "nccl"
    assert cuda.extra == "cuda"
    assert cuda.vendor_packages == ("triton", "flashinfer-python")
    assert cuda.auto_priority == 100


def test_cpu_only_torch_names_the_cuda_build_and_the_extra(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None)
    probe = CudaPlatform().probe()
    assert not probe.available and probe.device_count == 0
    assert f"torch {torch.__version__} has no CUDA support" in probe.reason
    assert "install a CUDA build of torch" in probe.reason
    assert 'pip install "omnirun[cuda]"' in probe.reason


def test_rocm_torch_points_to_the_rocm_device(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", "6.4.43482")
    probe = CudaPlatform().probe()
    assert not probe.available
    assert "ROCm build" in probe.reason and "--device rocm" in probe.reason


def test_no_gpu_points_to_the_driver(fake_gpu, monkeypatch: pytest.MonkeyPatch):
    fake_gpu.count = 0
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    probe = CudaPlatform().probe()
    assert not probe.available
    assert "no NVIDIA GPU is visible" in probe.reason and "nvidia-smi" in probe.reason
    assert "CUDA_VISIBLE_DEVICES" not in probe.reason


@pytest.mark.parametrize("value", ["", "7"])
def test_no_gpu_names_the_visibility_variable_when_set(fake_gpu, monkeypatch: pytest.MonkeyPatch, value: str):
    fake_gpu.count = 0
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)
    reason = CudaPlatform().probe().reason
    assert f"CUDA_VISIBLE_DEVICES={value!r} is set" in reason
    assert "\n" not in reason


def test_probe_counts_the_visible_gpus(fake_gpu):
    fake_gpu.count = 4
    cuda = CudaPlatform()
    assert cuda.probe().available
    assert cuda.device_count() == 4


def test_probe_reports_a_raising_torch_call_instead_of_raising(fake_gpu, monkeypatch: pytest.MonkeyPatch):
    def broken_device_count() -> int:
        raise RuntimeError("CUDA driver version is insufficient")

    monkeypatch.setattr(torch.cuda, "device_count", broken_device_count)
    probe = CudaPlatform().probe()
    assert not probe.available
    assert "RuntimeError: CUDA driver version is insufficient" in probe.reason


@pytest.mark.parametrize(
    ("capability", "dtypes", "fp8", "triton"),
    [
        ((7, 0), (torch.float16, torch.float32), None, False),  # V100
        ((7, 5), (torch.float16, torch.float32), None, True),  # T4
        ((8, 0), (torch.bfloat16, torch.float16, torch.float32), None, True),  # A100
        ((8, 9), (torch.bfloat16, torch.float16, torch.float32), torch.float8_e4m3fn, True),  # L40S
        ((9, 0), (torch.bfloat16, torch.float16, torch.float32), torch.float8_e4m3fn, True),  # H100/H200
    ],
)
def test_capabilities_follow_the_compute_capability(fake_gpu, capability, dtypes, fp8, triton):
    fake_gpu.capability = capability
    caps = CudaPlatform().capabilities
    assert caps.model_dtypes == dtypes
    assert caps.fp8_e4m3_dtype is fp8
    assert caps.fp8_e5m2_dtype is (torch.float8_e5m2 if fp8 else None)
    assert caps.supports_triton is triton


def test_graphs_are_cuda_graphs(fake_gpu):
    api = CudaPlatform().graph_api()
    assert api.name == "cuda_graph"
    cuda = torch.cuda
    assert (api.new_graph, api.capture, api.new_pool) == (cuda.CUDAGraph, cuda.graph, cuda.graph_pool_handle)


def test_capabilities_describe_the_current_device(fake_gpu):
    fake_gpu.current = 1
    caps = CudaPlatform().capabilities
    assert caps.device_name == "NVIDIA GPU 1"
    assert ("get_device_capability", 1) in fake_gpu.calls


def test_cuda_builds_triton_attention_with_its_tuned_decode_launch(fake_gpu, monkeypatch: pytest.MonkeyPatch):
    pytest.importorskip("triton")
    from omnirun.kernels.triton.attention_backend import TritonAttention

    monkeypatch.setattr(cuda_module, "triton_installed", lambda: True)
    monkeypatch.setattr(cuda_module, "flashinfer_installed", lambda: False)
    cuda = CudaPlatform()
    assert cuda.attention_backends() == ("triton", "torch_native")
    backend = cuda.attention_offer("triton").build(types.SimpleNamespace(deterministic=False))
    assert isinstance(backend, TritonAttention) and backend.name == "triton"
    assert backend._decode_launch["num_stages"] == 3  # the portable default is 2
    assert TritonAttention(types.SimpleNamespace(deterministic=False))._decode_launch["num_stages"] == 2


@pytest.mark.parametrize(
    ("capability", "env", "pdl"),
    [((9, 0), None, True), ((10, 0), None, True), ((8, 9), None, False), ((9, 0), "0", False)],
)
def test_triton_kernels_launch_with_pdl_from_hopper_on(fake_gpu, monkeypatch, capability, env, pdl):
    """Programmatic dependent launch on compute capability 9.0 and later unless OMNIRUN_CUDA_PDL=0: the attention
    backend, the portable fused ops (replaced by the same kernels launched with it) and the GEMV all get it."""
    pytest.importorskip("triton")
    from omnirun.devices.cuda import gemv
    from omnirun.kernels.triton import ops

    fake_gpu.capability = capability
    if env is None:
        monkeypatch.delenv(cuda_module.PDL_ENV, raising=False)
    else:
        monkeypatch.setenv(cuda_module.PDL_ENV, env)
    monkeypatch.setattr(cuda_module, "flashinfer_installed", lambda: False)
    cuda = CudaPlatform()
    assert cuda.uses_pdl() is pdl
    assert cuda.attention_offer("triton").build(types.SimpleNamespace(deterministic=False)).pdl is pdl
    fused = cuda.fused_ops()
    for name in ("rms_norm", "add_rms_norm", "silu_and_mul", "rotary_embedding", "linear"):
        op = fused[name]
        if pdl:
            assert op.keywords == {"pdl": True}, name
        else:
            assert op in (getattr(ops, name, None), gemv.linear), name
    assert fused["argmax"].pdl is pdl
    from omnirun.kernels.triton.int4_linear import int4_linear

    assert fused["int4_linear"] is int4_linear  # the portable W4A16 kernel, on every sm with Triton


def test_no_triton_without_the_package(fake_gpu, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(cuda_module, "triton_installed", lambda: False)
    monkeypatch.setattr(cuda_module, "flashinfer_installed", lambda: False)
    cuda = CudaPlatform()
    assert not cuda.capabilities.supports_triton
    assert cuda.attention_backends() == ("torch_native",)


def test_capabilities_of_an_unavailable_device_raise_the_probe_reason(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None)
    with pytest.raises(DeviceUnavailableError, match="has no CUDA support"):
        _ = CudaPlatform().capabilities


def test_memory_info_asks_the_current_or_named_device(fake_gpu):
    fake_gpu.current = 1
    cuda = CudaPlatform()
    assert cuda.memory_info() == (3 * GiB, 8 * GiB)
    assert cuda.memory_info(0) == (3 * GiB, 8 * GiB)
    asked = [device for name, device in fake_gpu.calls if name == "mem_get_info"]
    assert asked == [torch.device("cuda", 1), torch.device("cuda", 0)]


def test_peak_memory_routes_to_the_named_device(fake_gpu):
    cuda = CudaPlatform()
    assert cuda.peak_memory_allocated(1) == 5 * GiB
    cuda.reset_peak_memory(1)
    assert fake_gpu.calls == [
        ("max_memory_allocated", torch.device("cuda", 1)),
        ("reset_peak_memory_stats", torch.device("cuda", 1)),
    ]


def test_set_device_and_synchronize_route_to_torch_cuda(fake_gpu):
    cuda = CudaPlatform()
    cuda.set_device(1)
    cuda.synchronize(1)
    cuda.synchronize()
    assert fake_gpu.calls == [("set_device", 1), ("synchronize", 1), ("synchronize", None)]
    assert cuda.device(1) == torch.device("cuda", 1)


def test_import_and_probe_leave_vendor_packages_unimported(tmp_path):
    # Importable stand-ins, so an eager import would succeed and show up in sys.modules.
    for package in ("triton", "flashinfer", "aiter"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    code = (
        "import sys\n"
        "from omnirun.devices.cuda import platform\n"
        "platform.CudaPlatform().probe()\n"
        "assert platform.triton_installed(), 'the stand-in triton should be found'\n"
        "print(sorted(m for m in ('triton', 'flashinfer', 'aiter') if m in sys.modules))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
