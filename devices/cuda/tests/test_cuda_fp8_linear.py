"""cuda's `fp8_linear` on an NVIDIA GPU of sm89 or later: cuBLASLt's row-wise scaled GEMM (`torch._scaled_mm`) for
per-row weight scales at more than 16 rows, within 1 % of torch's per-token quantization of the activations times
the dequantized weight; and a model whose fp8 layers are kept gives the dequantized model's greedy tokens and logits
within the activation quantization's tolerance."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs an NVIDIA GPU (the cuda lane)", allow_module_level=True)
if torch.cuda.get_device_capability() < (8, 9):
    pytest.skip("fp8 matmuls need sm89 or later", allow_module_level=True)

from omnirun.devices.cuda.fp8_linear import fp8_linear  # noqa: E402
from omnirun.layers import native_ops  # noqa: E402

E4M3_MAX = 448.0


@pytest.mark.parametrize("rows", [17, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_scaled_mm_path_equals_per_token_quantization_times_the_weight(rows, bias):
    gen = torch.Generator(device="cuda").manual_seed(rows)
    n, k = 512, 1024
    w = torch.randn(n, k, device="cuda", generator=gen) * 0.05
    scale = w.abs().amax(1) / E4M3_MAX
    weight = (w / scale[:, None]).to(torch.float8_e4m3fn)
    x = torch.randn(rows, k, device="cuda", generator=gen).to(torch.bfloat16)
    b = torch.randn(n, device="cuda", generator=gen).to(torch.bfloat16) if bias else None
    got = fp8_linear(x, weight, scale, b, None).float()
    x_scale = x.float().abs().amax(1, keepdim=True).clamp(min=1e-12) / E4M3_MAX
    xq = (x.float() / x_scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() * x_scale
    emulated = xq @ native_ops.dequantize_fp8(weight, scale, None).t() + (b.float() if bias else 0)
    # cuBLASLt's fp8 tensor cores accumulate in reduced precision: a few elements stray by up to ~0.1 (seen on an
    # H100 and an H200), the whole stays within 1 %; a wrong scale or layout is far past it.
    assert ((got - emulated).norm() / emulated.norm()) < 1e-2
    exact = native_ops.fp8_linear(x.float(), weight, scale, None if b is None else b.float(), None)
    assert ((got - exact).norm() / exact.norm()) < 0.05


@pytest.mark.parametrize("block", [(128, 128), None], ids=["block", "per-tensor"])
def test_a_kept_fp8_model_gives_the_dequantized_model_s_tokens(tmp_path, block):
    from omnirun.devices.cuda.platform import CudaPlatform
    from omnirun.testing import greedy_generate, make_runner
    from quantized_checkpoints import PROMPTS, write_fp8_checkpoint

    write_fp8_checkpoint(tmp_path, "llama", block)
    platform = CudaPlatform()
    kept = make_runner(platform, tmp_path, dtype="bfloat16")
    try:
        assert "linear layers kept in fp8" in kept.describe()["weights"]
        tokens = greedy_generate(kept, PROMPTS, 8)
    finally:
        kept.close()

    class NoFp8Kernel(CudaPlatform):
        def fused_ops(self):  # the op and its hooks (prepare_fp8_linear, fp8_linear_takes)
            return {name: op for name, op in super().fused_ops().items() if "fp8_linear" not in name}

    dequantized = make_runner(NoFp8Kernel(), tmp_path, dtype="bfloat16")
    try:
        assert "dequantized to bfloat16 at load" in dequantized.describe()["weights"]
        assert greedy_generate(dequantized, PROMPTS, 8) == tokens
    finally:
        dequantized.close()


def test_kept_fp8_experts_give_the_dequantized_experts_tokens_in_graphs_and_eagerly(tmp_path):
    """A float32 mixture whose experts stay in fp8 (fp8_fused_moe, 16 x 16 blocks) against the same checkpoint with
    its experts dequantized at load (the platform without the op), and its decode graphs against eager steps (bf16
    is the kernels' own test: there the two roundings may part a greedy token of a random model)."""
    from omnirun.devices.cuda.platform import CudaPlatform
    from omnirun.testing import greedy_generate, make_runner, replayed_and_eager
    from quantized_checkpoints import PROMPTS, write_fp8_checkpoint

    write_fp8_checkpoint(tmp_path, "qwen3_moe", (16, 16))
    kept = make_runner(CudaPlatform(), tmp_path)
    try:
        assert "in fp8, fp8_fused_moe omnirun.kernels.triton.moe" in kept.describe()["experts"]
        tokens = greedy_generate(kept, PROMPTS, 8)
        replayed, eager = replayed_and_eager(kept, PROMPTS)
        torch.testing.assert_close(replayed, eager, atol=1e-5, rtol=0)
    finally:
        kept.close()

    class NoFp8Experts(CudaPlatform):
        def fused_ops(self):
            return {name: op for name, op in super().fused_ops().items() if name != "fp8_fused_moe"}

    dequantized = make_runner(NoFp8Experts(), tmp_path)
    try:
        assert "in fp8" not in dequantized.describe()["experts"]
        assert greedy_generate(dequantized, PROMPTS, 8) == tokens
    finally:
        dequantized.close()
