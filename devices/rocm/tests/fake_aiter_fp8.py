"""The fake aiter's fp8 GEMMs and activation quantizers (fake_aiter.make_aiter adds them), in plain torch on CPU.

Written from ROCm/aiter@e4048607a5: aiter/ops/quant.py (get_hip_quant, per_token_quant_hip, per_group_quant_hip over
csrc/kernels/quant_kernels.cu::dynamic_per_token_scaled_quant), aiter/ops/gemm_op_a8w8.py (gemm_a8w8_CK over
csrc/ck_gemm_a8w8, gemm_a8w8_blockscale over csrc/ck_gemm_a8w8_blockscale) and aiter/ops/enum.py's QuantType
(csrc/include/aiter_enum.h). They refuse what the kernels refuse or would read wrongly: fp8 of another encoding than
the GPU's (aiter's torch_fp8, csrc/include/py_itfs_common.h: e4m3fnuz on gfx94x), a quantizer input that is not
contiguous, operands whose strides the kernels do not read (the row-wise GEMM assumes StrideA = StrideB = K), scales
of other shapes or dtypes, outputs other than bf16/fp16, K not grouped by 128 for the block-scale path.
"""

from __future__ import annotations

import enum
import functools

import torch

HALF = (torch.bfloat16, torch.float16)
QUANT_INPUTS = (*HALF, torch.float32)
BLOCK = 128  # aiter's block-scale GEMM: 1 x 128 activation groups, 128 x 128 weight blocks


class QuantType(enum.Enum):
    """aiter.QuantType (a pybind enum in aiter; get_hip_quant keys by `.value`)."""

    No = 0
    per_Tensor = 1
    per_Token = 2
    per_1x32 = 3
    per_1x128 = 4
    per_128x128 = 5
    per_256x128 = 6
    per_1024x128 = 7


def fp8_api(e4m3: torch.dtype, require, counted) -> dict:
    """The fake functions for a GPU computing in `e4m3`; `require(condition, message)` raises aiter's check error,
    `counted(fn)` counts the calls."""

    def quantize(x: torch.Tensor, group: int, quant_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        require(x.dtype in QUANT_INPUTS, f"quant input {x.dtype} not supported")
        require(x.is_contiguous(), "input.is_contiguous()")  # dynamic_per_token_scaled_quant's AITER_CHECK
        # The kernel writes aiter's fp8 (this GPU's encoding) or int8; any other output type is refused.
        require(quant_dtype in (e4m3, torch.int8), f"not support output type: {quant_dtype}")
        cols = x.shape[-1]
        require(cols % group == 0, f"{cols} columns do not split into groups of {group}")
        top = torch.finfo(quant_dtype).max if quant_dtype.is_floating_point else torch.iinfo(quant_dtype).max
        groups = x.float().reshape(*x.shape[:-1], cols // group, group)
        scale = groups.abs().amax(-1, keepdim=True) / top
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)  # a row of zeros (aiter's torch reference)
        q = (groups / scale).clamp(-top, top)
        q = (q if quant_dtype.is_floating_point else q.round()).to(quant_dtype)
        return q.reshape(x.shape), scale.squeeze(-1)

    def per_token_quant_hip(x, scale=None, quant_dtype=torch.int8, num_rows=None, num_rows_factor=1):
        require(scale is None and num_rows is None, "not faked: static scales, num_rows")
        q, s = quantize(x, x.shape[-1], quant_dtype)
        return q, s.reshape(*x.shape[:-1], 1)  # [..., 1]

    def per_group_quant_hip(
        x, scale=None, quant_dtype=torch.int8, group_size=128, transpose_scale=False, num_rows=None, **kwargs
    ):
        require(scale is None and num_rows is None and not kwargs, "not faked: static scales, num_rows, e8m0")
        require(group_size in (32, 64, 128), f"unsupported group size {group_size=}")
        q, s = quantize(x, group_size, quant_dtype)
        if transpose_scale:  # the bytes in [groups, rows] order behind a [rows, groups] shape, as aiter does
            s = s.t().contiguous().view(s.shape)
        return q, s

    per_token = counted(per_token_quant_hip)
    per_group = counted(per_group_quant_hip)

    def get_hip_quant(qType):
        quantizers = {
            QuantType.per_Token.value: per_token,
            QuantType.per_1x128.value: functools.partial(per_group, group_size=128),
        }
        if qType.value not in quantizers:
            raise NotImplementedError(f"not faked: quant type {qType}")
        return quantizers[qType.value]

    def check_operands(XQ, WQ, x_scale, w_scale, dtype):
        require(XQ.dtype == WQ.dtype, "Weights and activations should have the same dtype!")
        require(XQ.dim() == 2 and WQ.dim() == 2 and XQ.shape[1] == WQ.shape[1], "XQ [M, K] and WQ [N, K]")
        require(x_scale.dtype == w_scale.dtype, "Scales should have the same dtype!")
        require(x_scale.dtype == torch.float32 and dtype in HALF, "Unsupported scales/output dtype!")

    def gemm_a8w8_CK(XQ, WQ, x_scale, w_scale, bias=None, dtype=torch.bfloat16, splitK=None):
        require(XQ.dtype in (e4m3, torch.int8), "Weights and activations should both be int8/fp8!")
        check_operands(XQ, WQ, x_scale, w_scale, dtype)
        m, n, k = XQ.shape[0], WQ.shape[0], XQ.shape[1]
        require(XQ.is_contiguous() and WQ.is_contiguous(), "the CK GEMM reads StrideA = StrideB = K")
        # The scales are read through raw pointers: M and N contiguous floats ([M, 1] / [N, 1] or [1, N]).
        require(x_scale.numel() == m and x_scale.is_contiguous(), f"x_scale: {m} contiguous floats")
        require(w_scale.numel() == n and w_scale.is_contiguous(), f"w_scale: {n} contiguous floats")
        require(bias is None or (bias.dtype == dtype and bias.numel() == n), "Out and bias should have the same dtype!")
        require(n % 16 == 0 and k % 16 == 0, "This GEMM is not supported!")  # as vLLM guards its calls
        out = (XQ.float() * x_scale.reshape(m, 1)) @ (WQ.float() * w_scale.reshape(n, 1)).t()
        if bias is not None:
            out += bias.float()
        return out.to(dtype)

    def gemm_a8w8_blockscale(XQ, WQ, x_scale, w_scale, dtype=torch.bfloat16, isBpreshuffled=False):
        assert dtype in HALF, f"Output {dtype=} is currently not supported in gemm_a8w8"  # aiter asserts
        require(not isBpreshuffled, "not faked: preshuffled weights")
        require(XQ.dtype == e4m3, f"the block-scale kernels read {e4m3} on this GPU, got {XQ.dtype}")
        check_operands(XQ, WQ, x_scale, w_scale, dtype)
        m, n, k = XQ.shape[0], WQ.shape[0], XQ.shape[1]
        require(XQ.stride(1) == 1 and WQ.stride(1) == 1, "rows of XQ and WQ must be contiguous")
        groups = -(-k // BLOCK)
        # Row-major x_scale [M, K / 128] (the non-preshuffled kernel; aiter's op test passes it untransposed).
        require(x_scale.shape == (m, groups) and x_scale.is_contiguous(), f"x_scale must be [{m}, {groups}]")
        require(w_scale.shape == (-(-n // BLOCK), groups) and w_scale.is_contiguous(), "w_scale: [N/128, K/128]")
        x = XQ.float() * x_scale.repeat_interleave(BLOCK, 1)[:, :k]
        w = WQ.float() * w_scale.repeat_interleave(BLOCK, 0)[:n].repeat_interleave(BLOCK, 1)[:, :k]
        return (x @ w.t()).to(dtype)

    return {
        "QuantType": QuantType,
        "get_hip_quant": get_hip_quant,
        "per_token_quant_hip": per_token,
        "gemm_a8w8_CK": counted(gemm_a8w8_CK),
        "gemm_a8w8_blockscale": counted(gemm_a8w8_blockscale),
    }
