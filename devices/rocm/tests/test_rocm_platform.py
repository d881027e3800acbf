"""RocmPlatform against a stubbed torch.cuda (ROCm torch keeps that API): runs anywhere, no GPU needed.

The stubs follow torch's signatures: device_count(), get_device_properties(device=None), mem_get_info(device=None)...
The device properties carry gcnArchName as ROCm torch reports it, feature flags included.
"""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest
import torch

from omnirun.assembly import Assembly, assemble
from omnirun.config import RunnerConfig
from omnirun.devices.rocm import platform as rocm_module
from omnirun.devices.rocm.gfx_arch import GfxArch
from omnirun.devices.rocm.platform import VISIBILITY_ENVS, RocmPlatform
from omnirun_fakes.lane import without_fake_lane

GiB = 1 << 30
BF16_FIRST = (torch.bfloat16, torch.float16, torch.float32)
NO_BF16 = (torch.float16, torch.float32)
FNUZ = (torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)
OCP = (torch.float8_e4m3fn, torch.float8_e5m2)


@pytest.fixture
def fake_gpu(monkeypatch: pytest.MonkeyPatch) -> types.SimpleNamespace:
    """A ROCm build of torch seeing GPUs; a test sets count/arch/current and reads the recorded calls."""
    gpu = types.SimpleNamespace(count=8, arch="gfx942:sramecc+:xnack-", name="AMD Instinct MI300X", current=0, calls=[])

    def record(name, result=None):
        def call(device=None):
            gpu.calls.append((name, device))
            return result(device) if callable(result) else result

        return call

    def properties(device):
        return types.SimpleNamespace(name=gpu.name, gcnArchName=gpu.arch, total_memory=192 * GiB)

    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", "6.4.43482")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpu.count)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: gpu.current)
    monkeypatch.setattr(torch.cuda, "get_device_properties", record("get_device_properties", properties))
    monkeypatch.setattr(torch.cuda, "mem_get_info", record("mem_get_info", (100 * GiB, 192 * GiB)))
    monkeypatch.setattr(torch.cuda, "set_device", record("set_device"))
    monkeypatch.setattr(torch.cuda, "synchronize", record("synchronize"))
    monkeypatch.setattr(rocm_module, "triton_installed", lambda: True)
    for env in VISIBILITY_ENVS:
        monkeypatch.delenv(env, raising=False)
    return gpu


def test_identity():
    rocm = RocmPlatform()
    assert (rocm.name, rocm.torch_device_type, rocm.dispatch_key) == ("rocm", "cuda", "CUDA")
    assert rocm.visible_devices_env == "HIP_VISIBLE_DEVICES"
    assert rocm.distributed_backend == "nccl"
    assert rocm.extra == "rocm"
    assert rocm.vendor_packages == ("triton", "amd-aiter")
    assert rocm.auto_priority == 100


def test_cpu_only_torch_names_the_rocm_build_and_the_extra(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None)
    probe = RocmPlatform().probe()
    assert not probe.available and probe.device_count == 0
    assert f"torch {torch.__version__} has no ROCm support" in probe.reason
    assert "install a ROCm build of torch" in probe.reason
    assert 'pip install "omnirun[rocm]"' in probe.reason


def test_cuda_torch_points_to_the_cuda_device(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.version, "hip", None)
    probe = RocmPlatform().probe()
    assert not probe.available
    assert "CUDA build" in probe.reason and "--device cuda" in probe.reason


def test_no_gpu_points_to_the_driver(fake_gpu):
    fake_gpu.count = 0
    probe = RocmPlatform().probe()
    assert not probe.available
    assert "no AMD GPU is visible" in probe.reason and "rocm-smi" in probe.reason
    assert "VISIBLE_DEVICES" not in probe.reason


def test_no_gpu_names_every_visibility_variable_that_is_set(fake_gpu, monkeypatch: pytest.MonkeyPatch):
    fake_gpu.count = 0
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "")
    monkeypatch.setenv("ROCR_VISIBLE_DEVICES", "3")
    reason = RocmPlatform().probe().reason
    assert "HIP_VISIBLE_DEVICES='', ROCR_VISIBLE_DEVICES='3' are set" in reason
    assert "CUDA_VISIBLE_DEVICES" not in reason


def test_probe_counts_the_visible_gpus(fake_gpu):
    rocm = RocmPlatform()
    assert rocm.probe().available
    assert rocm.device_count() == 8


def test_probe_reports_a_raising_torch_call_instead_of_raising(fake_gpu, monkeypatch: pytest.MonkeyPatch):
    def broken_device_count() -> int:
        raise RuntimeError("hipErrorNoDevice")

    monkeypatch.setattr(torch.cuda, "device_count", broken_device_count)
    probe = RocmPlatform().probe()
    assert not probe.available
    assert "RuntimeError: hipErrorNoDevice" in probe.reason


@pytest.mark.parametrize(
    ("gcn_arch_name", "parsed"),
    [
        ("gfx942:sramecc+:xnack-", (9, 4, 2)),
        ("gfx90a:sramecc+:xnack-", (9, 0, 10)),
        ("gfx950", (9, 5, 0)),
        ("gfx1100", (11, 0, 0)),
        ("gfx1201", (12, 0, 1)),
    ],
)
def test_gfx_targets_parse_with_hex_minor_and_stepping(gcn_arch_name, parsed):
    assert GfxArch.parse(gcn_arch_name) == parsed


@pytest.mark.parametrize("bad", ["", "gfx", "gfx9", "sm_90", "gfxab0"])
def test_a_name_that_is_not_a_gfx_target_is_rejected(bad):
    with pytest.raises(ValueError, match="not an AMD gfx target"):
        GfxArch.parse(bad)


@pytest.mark.parametrize(
    ("gcn_arch_name", "dtypes", "fp8"),
    [
        ("gfx906:sramecc+:xnack-", NO_BF16, (None, None)),  # MI50 (Vega 20)
        ("gfx908:sramecc+:xnack-", BF16_FIRST, (None, None)),  # MI100
        ("gfx90a:sramecc+:xnack-", BF16_FIRST, (None, None)),  # MI210/MI250
        ("gfx942:sramecc+:xnack-", BF16_FIRST, FNUZ),  # MI300X/MI325X
        ("gfx950:sramecc+:xnack-", BF16_FIRST, OCP),  # MI350X/MI355X
        ("gfx1030", NO_BF16, (None, None)),  # RX 6900 XT (RDNA2)
        ("gfx1100", BF16_FIRST, (None, None)),  # RX 7900 XTX (RDNA3)
        ("gfx1201", BF16_FIRST, OCP),  # RX 9070 XT (RDNA4)
    ],
)
def test_capabilities_follow_the_gfx_arch(fake_gpu, gcn_arch_name, dtypes, fp8):
    fake_gpu.arch = gcn_arch_name
    caps = RocmPlatform().capabilities
    assert caps.model_dtypes == dtypes
    assert (caps.fp8_e4m3_dtype, caps.fp8_e5m2_dtype) == fp8
    assert caps.supports_triton


def test_graphs_are_hip_graphs_through_torch_cuda(fake_gpu):
    api = RocmPlatform().graph_api()
    assert api.name == "hip_graph"
    cuda = torch.cuda
    assert (api.new_graph, api.capture, api.new_pool) == (cuda.CUDAGraph, cuda.graph, cuda.graph_pool_handle)


def test_capabilities_describe_the_current_device_by_name_and_target(fake_gpu):
    fake_gpu.current = 3
    caps = RocmPlatform().capabilities
    assert caps.device_name == "AMD Instinct MI300X (gfx942)"
    assert fake_gpu.calls == [("get_device_properties", 3)]


def test_no_triton_without_the_package(fake_gpu, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(rocm_module, "triton_installed", lambda: False)
    assert not RocmPlatform().capabilities.supports_triton


def test_memory_info_asks_the_current_or_named_device(fake_gpu):
    fake_gpu.current = 2
    rocm = RocmPlatform()
    assert rocm.memory_info() == (100 * GiB, 192 * GiB)
    assert rocm.memory_info(5) == (100 * GiB, 192 * GiB)
    assert fake_gpu.calls == [("mem_get_info", torch.device("cuda", 2)), ("mem_get_info", torch.device("cuda", 5))]


def test_set_device_and_synchronize_route_to_torch_cuda(fake_gpu):
    rocm = RocmPlatform()
    rocm.set_device(4)
    rocm.synchronize(4)
    assert fake_gpu.calls == [("set_device", 4), ("synchronize", 4)]
    assert rocm.device(4) == torch.device("cuda", 4)


def test_import_and_probe_leave_vendor_packages_unimported(tmp_path):
    # Importable stand-ins, so an eager import would succeed and show up in sys.modules.
    for package in ("triton", "aiter", "flashinfer"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    code = (
        "import sys\n"
        "from omnirun.devices.rocm import platform\n"
        "platform.RocmPlatform().probe()\n"
        "assert platform.triton_installed(), 'the stand-in triton should be found'\n"
        "print(sorted(m for m in ('triton', 'aiter', 'flashinfer') if m in sys.modules))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


# --- aiter offered where it is installed; triton and torch_native otherwise ---
def _plan(platform: RocmPlatform, dtype=torch.bfloat16, **config) -> Assembly:
    """What a runner with these flags would build here (a real RunnerConfig; nothing is loaded)."""
    return assemble(RunnerConfig(model="stand-in", **config), platform, dtype, 8)


def test_without_aiter_the_portable_parts_only(fake_gpu, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(rocm_module, "aiter_installed", lambda: False)
    rocm = RocmPlatform()
    assert rocm.attention_offers() == ()
    assert rocm.attention_backends() == ("triton", "torch_native")
    assert rocm.default_attention_backend("decode") == rocm.default_attention_backend_for("decode", torch.bfloat16)
    assert rocm.default_attention_backend("decode") == "triton"
    assert rocm.device_fused_ops() == {}
    assert "fp8_fused_moe" in rocm.fused_ops()  # an MI300X: fp8 experts on the portable Triton kernels
    monkeypatch.setattr(rocm_module, "triton_installed", lambda: False)
    no_triton = RocmPlatform()
    assert no_triton.device_fused_ops() == {}
    assert no_triton.attention_backends() == ("torch_native",)
    assert no_triton.default_attention_backend("prefill") == "torch_native"


def test_with_aiter_it_is_offered_after_triton_and_only_on_request(fake_gpu, aiter):
    rocm = RocmPlatform()
    assert rocm_module.aiter_installed()
    assert rocm.attention_backends() == ("triton", "aiter", "torch_native")
    for mode in ("prefill", "decode"):
        assert rocm.default_attention_backend(mode) == "triton"
        assert rocm.default_attention_backend_for(mode, torch.bfloat16) == "triton"
    ops = rocm.device_fused_ops()
    fp8 = {"fp8_linear", "prepare_fp8_linear", "fp8_linear_takes"}  # an MI300X
    assert set(ops) == {"rms_norm", "add_rms_norm", *fp8}
    assert set(rocm.fused_ops()) >= set(ops)  # aiter's norms replace the portable ones of the same name
    assert "int4_linear" in rocm.fused_ops()  # the portable Triton kernel, as without aiter


@pytest.mark.parametrize(
    ("gcn_arch_name", "aiter_gfx", "kept"),
    [
        ("gfx942:sramecc+:xnack-", "gfx942", torch.float8_e4m3fnuz),  # MI300X: aiter's CK fp8 GEMMs, in fnuz
        ("gfx950:sramecc+:xnack-", "gfx950", torch.float8_e4m3fn),  # MI355X: the same GEMMs, in OCP e4m3
        ("gfx90a:sramecc+:xnack-", "gfx942", None),  # MI250: no fp8
        ("gfx1201", "gfx950", None),  # RX 9070 XT: fp8, but aiter ships its CK GEMMs for CDNA only
    ],
)
def test_fp8_linear_is_offered_on_cdna_gpus_with_fp8(fake_gpu, use_aiter, gcn_arch_name, aiter_gfx, kept):
    from omnirun.layers.ops import resolve_ops, runs_fp8_weights

    fake_gpu.arch = gcn_arch_name
    use_aiter(aiter_gfx)
    rocm = RocmPlatform()
    ops = resolve_ops(rocm.fused_ops())
    assert runs_fp8_weights(ops) == (kept is not None)  # layers keep fp8 checkpoints' weights, or dequantize them
    if kept is not None:
        weight = torch.zeros(16, 32, dtype=torch.float8_e4m3fn)
        assert ops.prepare_fp8_linear(weight, torch.ones(16), None).weight.dtype == kept


@pytest.mark.parametrize(
    ("gcn_arch_name", "fnuz"),
    [
        ("gfx942:sramecc+:xnack-", True),  # MI300X: e4m3fnuz, converted natively; the e4m3fn bits read as fnuz
        ("gfx950:sramecc+:xnack-", False),  # MI355X: OCP e4m3, as stored
        ("gfx1201", False),  # RX 9070 XT: OCP e4m3
        ("gfx90a:sramecc+:xnack-", None),  # MI250: no fp8, the experts are dequantized at load
    ],
)
def test_fp8_experts_stay_in_fp8_on_the_triton_kernels_where_the_gpu_has_fp8(
    fake_gpu, monkeypatch: pytest.MonkeyPatch, gcn_arch_name, fnuz
):
    from omnirun.kernels.triton.moe import fp8_fused_moe
    from omnirun.layers.ops import resolve_ops, runs_fp8_experts

    monkeypatch.setattr(rocm_module, "aiter_installed", lambda: False)  # aiter or not
    fake_gpu.arch = gcn_arch_name
    ops = resolve_ops(RocmPlatform().fused_ops())
    assert runs_fp8_experts(ops) == (fnuz is not None)
    if fnuz is not None:
        assert ops.fp8_fused_moe.func is fp8_fused_moe and ops.fp8_fused_moe.keywords["fnuz"] is fnuz


def test_no_graph_runner_when_decode_runs_on_torch_native(fake_gpu, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(rocm_module, "triton_installed", lambda: False)
    monkeypatch.setattr(rocm_module, "aiter_installed", lambda: False)
    rocm = RocmPlatform()
    assert _plan(rocm).graphs is None  # the default: torch_native
    assert _plan(rocm, attention_backend="torch_native").graphs is None
    monkeypatch.setattr(rocm_module, "aiter_installed", lambda: True)
    plan = _plan(RocmPlatform(), decode_attention_backend="aiter")
    assert plan.graphs == "hip_graph" and plan.graph_max_batch_size == 8


def test_import_of_the_aiter_modules_imports_no_aiter():
    code = (
        "import sys\n"
        "import omnirun.devices.rocm.aiter_attention, omnirun.devices.rocm.aiter_ops\n"
        "import omnirun.devices.rocm.aiter_fp8, omnirun.devices.rocm.fnuz\n"
        "print('aiter' in sys.modules)\n"
    )
    # without_fake_lane: the rocm-fake lane would install a fake aiter in the child
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=without_fake_lane())
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
