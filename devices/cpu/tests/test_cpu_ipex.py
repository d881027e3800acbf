"""The cpu platform's IPEX decision: a matching CPU build of IPEX adds the ipex backend (on request) and IPEX's rms
norms; anything else (no IPEX, a mismatched or an XPU build) leaves the platform as it is, with `omnirun env` saying
why. IPEX cannot be installed here (torch 2.13): the fake IPEX of the xpu tests stands in for it, loaded by path."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from omnirun.devices.cpu.platform import CpuPlatform

FAKE = Path(__file__).resolve().parents[2] / "xpu" / "tests" / "fake_ipex.py"


@pytest.fixture
def install_ipex(monkeypatch: pytest.MonkeyPatch, tmp_path):
    spec = importlib.util.spec_from_file_location("cpu_tests_fake_ipex", FAKE)
    fake = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fake)

    def install(build: str, version: str | None = None):
        version = version or fake.matching_version(build)
        module = fake.make_ipex(build, version)
        fake.install_metadata(tmp_path / version, version)
        monkeypatch.syspath_prepend(str(tmp_path / version))
        monkeypatch.setitem(sys.modules, "intel_extension_for_pytorch", module)
        return module

    return install


def test_without_ipex_nothing_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "intel_extension_for_pytorch" else real(name, *a)
    )
    platform = CpuPlatform()
    assert platform.attention_backends() == ("torch_native",)
    assert sorted(platform.device_fused_ops()) == ["linear", "prepare_linear"]
    assert platform.notes() == ()


def test_matching_cpu_build_is_used(install_ipex, tiny_checkpoints) -> None:
    ipex = install_ipex("cpu")
    platform = CpuPlatform()
    assert platform.attention_backends() == ("ipex", "torch_native")
    assert platform.default_attention_backend("decode") == "torch_native"  # ipex on request
    assert sorted(platform.device_fused_ops()) == ["add_rms_norm", "linear", "prepare_linear", "rms_norm"]
    from omnirun.testing import greedy_generate, hf_greedy, make_runner

    checkpoint = tiny_checkpoints["llama"]
    runner = make_runner(platform, checkpoint.plain, attention_backend="ipex")
    try:
        prompts = [[5, 9, 2, 7, 1], [3, 3, 8]]
        assert greedy_generate(runner, prompts, 6) == [hf_greedy(checkpoint.hf_model, p, 6) for p in prompts]
    finally:
        runner.close()
    assert ipex.calls["single_query_cached_kv_attention"] > 0 and ipex.calls["flash_attn_varlen_func"] > 0
    assert ipex.calls["rms_norm"] > 0 and ipex.calls["add_rms_norm"] > 0


@pytest.mark.parametrize("build,version", [("cpu", "2.8.0+cpu"), ("xpu", None)])
def test_other_ipex_is_not_used(install_ipex, build, version) -> None:
    module = install_ipex(build, version)
    module.llm = None  # a mismatched IPEX exits the process on import: nothing of it may be touched
    platform = CpuPlatform()
    assert platform.attention_backends() == ("torch_native",)
    assert sorted(platform.device_fused_ops()) == ["linear", "prepare_linear"]
    (note,) = platform.notes()
    found = ".".join(torch.__version__.split(".")[:2])
    if version:
        assert note == f"ipex: intel-extension-for-pytorch 2.8.0+cpu needs torch 2.8, found {found}"
    else:
        assert note.endswith(f"{module.__version__} is a XPU build; the cpu platform needs its CPU build")
