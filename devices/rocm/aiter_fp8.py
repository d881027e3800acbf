"""fp8 linear layers on aiter's W8A8 GEMMs: the op table's `fp8_linear` and `prepare_fp8_linear`.

- `prepare_fp8_linear` makes, once after loading and after each weight update, the weight in the fp8 encoding the GPU
  computes in (aiter.dtypes.fp8: float8_e4m3fnuz on gfx942, float8_e4m3fn on gfx950; ROCm/aiter:aiter/utility/
  dtypes.py) and the scales in the layout the GEMMs read. Memory: on gfx942 a second copy of every kept fp8 weight
  (one byte per element, the loaded e4m3fn tensors staying for weight updates and get_weights_by_name) plus its
  scales; on gfx950 the loaded tensors are used as they are (no copy).
- `fp8_linear`, for more than WEIGHT_ONLY_MAX_ROWS rows of bf16/fp16 activations: per-row scales (per channel, or
  per tensor repeated per row) quantize each token to fp8 and run aiter's row-wise scaled GEMM; 128 x 128 blocks
  quantize each token per 128 columns and run aiter's block-scale GEMM. The activation quantization moves each
  product by ~2^-4 / sqrt(3) of its size per element (e4m3's 3 mantissa bits); vLLM's and SGLang's aiter paths
  quantize the same way.
- Decode-sized rows (WEIGHT_ONLY_MAX_ROWS or fewer) keep their activations unquantized, as cuda's op does (the
  conformance suite's decode-sized fp8 check is 2-3x tighter than fp8 activations): the portable Triton weight-only
  kernel on the prepared weight where the platform runs Triton (it widens each fp8 tile as it reads it, in the GPU's
  own encoding; checked in Triton's interpreter, never yet compiled for an AMD GPU), else the torch reference.
- Everything aiter does not take (float32 models, shapes its kernels are not built for, other block sizes) goes to
  the torch reference on the loaded tensors: correct, not fast. The checks read only shapes and dtypes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from omnirun.attention.backend import HALF_DTYPES
from omnirun.devices.rocm.fnuz import e4m3fn_as_fnuz
from omnirun.layers import native_ops

# The aiter functions the op calls; an aiter without any of them offers no fp8_linear (weights dequantized at load).
AITER_FP8_API = ("QuantType", "get_hip_quant", "gemm_a8w8_CK", "gemm_a8w8_blockscale")
# Rows up to which activations stay unquantized (omnirun.kernels.triton.fp8_linear.WEIGHT_ONLY_MAX_ROWS, cuda's).
WEIGHT_ONLY_MAX_ROWS = 16
# aiter's block-scale GEMM scales 1 x 128 activation groups and 128 x 128 weight blocks (Scale_Block_N/K = 128 in
# ROCm/aiter:csrc/ck_gemm_a8w8_blockscale/include/gemm_a8w8_blockscale_common.cuh).
AITER_BLOCK = (128, 128)
# Row-wise GEMM: vLLM asserts N and K multiples of 16 before calling gemm_a8w8_CK
# (vllm-project/vllm:vllm/model_executor/kernels/linear/scaled_mm/aiter.py: AiterInt8ScaledMMLinearKernel asserts
# it, AiterPreshuffledPerTokenFp8ScaledMMLinearKernel requires it).
ROWWISE_MULTIPLE = 16


@dataclasses.dataclass(frozen=True)
class AiterFp8Weight:
    """A kept fp8 weight as the GPU's kernels read it."""

    weight: torch.Tensor  # [N, K] contiguous, in aiter's fp8 encoding
    scale: torch.Tensor  # float32: [N, 1] per row, or [ceil(N / rows), ceil(K / cols)] per block, contiguous


def prepare(fp8: torch.dtype, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None):
    """`prepare_fp8_linear` for a GPU computing in `fp8`."""
    if fp8 == torch.float8_e4m3fnuz:
        weight, scale = e4m3fn_as_fnuz(weight, scale)
    scale = scale.float().reshape(-1, 1) if block is None else scale.float()
    return AiterFp8Weight(weight.contiguous(), scale.contiguous())


def _rowwise_fits(n: int, k: int, block: tuple[int, int] | None) -> bool:
    return block is None and n % ROWWISE_MULTIPLE == 0 and k % ROWWISE_MULTIPLE == 0


def _blockscale_fits(n: int, k: int, block: tuple[int, int] | None) -> bool:
    # Whole blocks only: the activation quantizer groups K by 128 (ROCm/aiter:aiter/ops/quant.py::
    # per_group_quant_hip views x as [-1, 128]; vLLM's _rocm_aiter_group_fp8_quant_impl asserts K % 128), and
    # every shape aiter tunes and tests has N a multiple of 128 too (aiter/configs/a8w8_blockscale_tuned_gemm.csv).
    return block is not None and tuple(block) == AITER_BLOCK and n % AITER_BLOCK[0] == 0 and k % AITER_BLOCK[1] == 0


def route(rows: int, n: int, k: int, dtype: torch.dtype, block: tuple[int, int] | None, weight_only: Any) -> str:
    """Which path computes a call: "weight_only", "rowwise", "blockscale" or "reference" (see the module's doc);
    `weight_only` is the Triton fp8 kernels' module, or None where the platform runs no Triton."""
    if dtype not in HALF_DTYPES:
        return "reference"  # aiter's fp8 GEMMs write bf16/fp16 only
    if rows <= WEIGHT_ONLY_MAX_ROWS:
        return "weight_only" if weight_only is not None and weight_only.fits(block) else "reference"
    if _rowwise_fits(n, k, block):
        return "rowwise"
    if _blockscale_fits(n, k, block):
        return "blockscale"
    return "reference"


def aiter_fp8_ops(aiter: Any, fp8: torch.dtype, triton: bool) -> dict[str, Callable[..., Any]]:
    """{"fp8_linear", "prepare_fp8_linear"} over `aiter` (imported), for a GPU computing in `fp8` (which must be
    aiter.dtypes.fp8); `triton`: whether the platform runs the portable Triton kernels. {} where aiter lacks the
    GEMMs or computes in another fp8."""
    if aiter.dtypes.fp8 != fp8 or not all(hasattr(aiter, name) for name in AITER_FP8_API):
        return {}
    # ROCm/aiter:aiter/ops/quant.py::get_hip_quant: per_Token -> per_token_quant_hip(x, quant_dtype=...) returning
    # (fp8 [M, K], float32 scales [M, 1]); per_1x128 -> per_group_quant_hip(x, quant_dtype=..., group_size=128)
    # returning scales [M, K / 128] row-major (transpose_scale False), as vLLM's _rocm_aiter_group_fp8_quant_impl
    # (vllm-project/vllm:vllm/_aiter_ops.py) and SGLang's aiter_w8a8_block_fp8_linear call them.
    per_token = aiter.get_hip_quant(aiter.QuantType.per_Token)
    per_group = aiter.get_hip_quant(aiter.QuantType.per_1x128)
    weight_only = None
    if triton:
        from omnirun.kernels.triton import fp8_linear as triton_fp8  # imports triton

        weight_only = triton_fp8

    def prepare_fp8_linear(weight: torch.Tensor, weight_scale: torch.Tensor, block: tuple[int, int] | None):
        return prepare(fp8, weight, weight_scale, block)

    def fp8_linear(
        x: torch.Tensor,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        bias: torch.Tensor | None,
        block: tuple[int, int] | None,
        prepared: AiterFp8Weight | None = None,
    ) -> torch.Tensor:
        n, k = weight.shape
        rows = x.reshape(-1, k)
        path = route(rows.shape[0], n, k, x.dtype, block, weight_only)
        if path == "reference":
            return native_ops.fp8_linear(x, weight, weight_scale, bias, block)
        form = prepared if prepared is not None else prepare(fp8, weight, weight_scale, block)
        rows = rows.contiguous()
        if path == "weight_only":
            out = weight_only.weight_only(rows, form.weight, form.scale, bias, block)
        else:
            if path == "rowwise":
                q, x_scale = per_token(rows, quant_dtype=fp8)
                # ROCm/aiter:aiter/ops/gemm_op_a8w8.py::gemm_a8w8_CK(XQ [M, K], WQ [N, K], x_scale, w_scale, bias,
                # dtype): scales read as M and N contiguous floats (csrc/ck_gemm_a8w8/include/
                # gemm_a8w8_common.cuh), called as vLLM's _rocm_aiter_gemm_a8w8_impl does.
                out = aiter.gemm_a8w8_CK(q, form.weight, x_scale, form.scale, None, x.dtype)
            else:
                q, x_scale = per_group(rows, quant_dtype=fp8)
                # ROCm/aiter:aiter/ops/gemm_op_a8w8.py::gemm_a8w8_blockscale(XQ [M, K], WQ [N, K], x_scale
                # [M, K / 128], w_scale [N / 128, K / 128], dtype), as SGLang's aiter_w8a8_block_fp8_linear
                # (sgl-project/sglang:python/sglang/srt/layers/quantization/fp8_utils.py) calls it.
                out = aiter.gemm_a8w8_blockscale(q, form.weight, x_scale, form.scale, dtype=x.dtype)
            # Bias after the GEMM, as SGLang does: aiter's own fp8 GEMM test passes none
            # (ROCm/aiter:op_tests/test_gemm_a8w8.py, "CK fp8 kernel set bias=None").
            if bias is not None:
                out += bias
        return out.reshape(*x.shape[:-1], n)

    def fp8_linear_takes(n: int, k: int, block: tuple[int, int] | None, dtype: torch.dtype) -> bool:
        # Layers whose every call has a kernel (decode rows the Triton weight-only one, more rows aiter's): the rest
        # are dequantized at load rather than run the reference, which dequantizes at every call.
        decode = weight_only is not None and weight_only.fits(block)
        return dtype in HALF_DTYPES and decode and (_rowwise_fits(n, k, block) or _blockscale_fits(n, k, block))

    return {"fp8_linear": fp8_linear, "prepare_fp8_linear": prepare_fp8_linear, "fp8_linear_takes": fp8_linear_takes}
