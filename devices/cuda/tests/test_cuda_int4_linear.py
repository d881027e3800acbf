"""cuda's `int4_linear` on an NVIDIA GPU: the portable Triton W4A16 kernel compiled (GEMV at one row, 16-row dots,
the GEMM's tiles) against the torch reference that dequantizes as a load does, on the 8B preset's projection shapes
in bf16 and fp16; and an AWQ and a GPTQ model whose layers are kept packed give the greedy tokens of the same
checkpoint dequantized at load."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs an NVIDIA GPU (the cuda lane)", allow_module_level=True)
pytest.importorskip("triton", reason="the int4 kernel is Triton's")

from omnirun.kernels.triton import int4_linear as kernels  # noqa: E402
from omnirun.layers import native_ops  # noqa: E402
from omnirun.quantization.int4 import pack_int4_rows  # noqa: E402


def _weight(n: int, k: int, group: int, gen: torch.Generator):
    groups = -(-k // group)
    q = torch.randint(0, 16, (n, k), generator=gen, device="cuda")
    scale = (torch.rand(n, groups, generator=gen, device="cuda") * 0.004 + 0.001).half().float()
    zero = torch.randint(0, 16, (n, groups), generator=gen, device="cuda").to(torch.uint8)
    return pack_int4_rows(q), scale, zero


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 16, 100, 512])  # the GEMV at 1-3 rows
@pytest.mark.parametrize("n, k, group", [(6144, 4096, 128), (4096, 14336, 128), (1000, 1032, 32)])
def test_the_kernel_equals_the_reference(rows, n, k, group, dtype):
    gen = torch.Generator(device="cuda").manual_seed(rows + n)
    packed, scale, zero = _weight(n, k, group, gen)
    x = torch.randn(rows, k, device="cuda", generator=gen).to(dtype)
    bias = torch.randn(n, device="cuda", generator=gen).to(dtype)
    got = kernels.int4_linear(x, packed, scale, zero, bias, group).float()
    expected = native_ops.int4_linear(x.float(), packed, scale, zero, bias.float(), group)
    # the output rounded to 16 bits, and (at more than one row) the weight rounded to x's dtype before the dots
    torch.testing.assert_close(got, expected, atol=6e-2, rtol=1.6e-2)
    assert ((got - expected).norm() / expected.norm()) < 5e-3


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_a_kept_int4_model_gives_the_dequantized_model_s_tokens(tmp_path, method):
    from omnirun.devices.cuda.platform import CudaPlatform
    from omnirun.testing import greedy_generate, make_runner
    from quantized_checkpoints import PROMPTS, write_int4_checkpoint

    write_int4_checkpoint(tmp_path, "llama", method, 16)
    platform = CudaPlatform()
    kept = make_runner(platform, tmp_path, dtype="bfloat16")
    try:
        assert "8 linear layers kept in int4 (int4_linear" in kept.describe()["weights"]
        tokens = greedy_generate(kept, PROMPTS, 8)
    finally:
        kept.close()

    class NoInt4Kernel(CudaPlatform):
        def fused_ops(self):  # the portable Triton op and its hooks (int4_linear_takes)
            return {name: op for name, op in super().fused_ops().items() if "int4_linear" not in name}

    dequantized = make_runner(NoInt4Kernel(), tmp_path, dtype="bfloat16")
    try:
        assert "dequantized to bfloat16 at load" in dequantized.describe()["weights"]
        assert greedy_generate(dequantized, PROMPTS, 8) == tokens
    finally:
        dequantized.close()
