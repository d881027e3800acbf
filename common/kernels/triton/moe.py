"""The `fused_moe` op in Triton: a mixture of experts as two grouped GEMMs, with no host sync (graph-capturable).

As vLLM's and SGLang's fused_moe do: each (token, k-th choice) pair is a *slot*; slots are sorted by expert and
each expert's run padded to a whole number of BLOCK_M rows, so that every block of rows belongs to one expert.
One launch multiplies every block by its expert's gate|up weights, the activation runs on all slots at once, a
second launch multiplies by the experts' down weights and the routing weight, and each token sums its top_k slots.
The grid is sized for the most blocks the slots can fill (every expert's run padded), and blocks past the real
total return at once: the sizes depend on the token count alone, never on the routing, so nothing waits for the
host.

A decode step (a few tokens) takes another path: sorting and padding would cost more launches than the work, so
each slot multiplies its token by its expert's rows directly (a GEMV, gate|up and the activation in one launch), and
each token sums its slots' down projections in a second, weighted, in float32: three launches with the routing, where
the grouped path makes about twenty. The routing is one launch on either path (float32 softmax, top-k with the first
index winning ties, renormalisation), computed as HF's routers compute it.

Experts kept in fp8 (`fp8_fused_moe`) take the same kernels: each fp8 tile is widened in registers and multiplied by
its per-row or block scales (`_widened`), so a step reads half the bytes of bf16's; the activations stay unquantized.
Experts kept in 4 bits (`int4_fused_moe`, AWQ/GPTQ checkpoints: eight inputs an int32 word, a scale and a zero point
per row and group of inputs) read a quarter of bf16's bytes, with int4_linear's arithmetic. The grouped GEMMs take
int4_linear's GEMM step (`_dot_nibbles`: a step lies in one group, the dot takes q - z exactly in x's dtype and the
group's scale multiplies the step's product). The decode path has kernels of its own (`_slot_gate_up_int4_kernel`,
`_token_down_int4_kernel`) with its one-row GEMV products: each thread multiplies the nibbles of the words it holds
in place and sums them by word. sm90 SASS a weight in their loops: 4.0 instructions (gate|up, 16 x 1,024), 6.1
(down, 16 x 256); the first version, which dequantized each tile in float32 (q - z) x s for the shared kernels, ran
15.8 and 17.8 on the decode path (4 x 512) and 25 in the grouped GEMMs (16 x 64 x 128, with spills).

Importing this module imports triton; the capability gate (omnirun.kernels) offers it only where triton runs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from omnirun.kernels.triton.int4_linear import _MAGIC_16, _dot_nibbles, _int4_step, _load_row, _row_part, k_step
from omnirun.kernels.triton.modes import INTERPRETED
from omnirun.kernels.triton.moe_tiles import DEFAULT, MoeTiles

_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _widened(
    w,
    s_ptr,
    rows,
    row_mask,
    k0,
    K,
    stride_sn,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SCALE_ROWS: tl.constexpr,  # 0: plain weights; 1: one scale per row; else the rows of a block of scales
    SCALE_COLS: tl.constexpr,  # 0: one scale per row; else the columns of a block
    FNUZ: tl.constexpr = False,  # w: the bits (uint8) of e4m3fn values, read as e4m3fnuz (see _fnuz)
):
    """A weight tile [BLOCK_N, BLOCK_K] (its `rows`, columns k0..) in float32: as stored, or, of an fp8 weight, each
    value times its scale (`s_ptr`: the expert's scales, [rows] or [row blocks, column blocks])."""
    GROUP: tl.constexpr = BLOCK_K if SCALE_COLS == 0 else min(SCALE_COLS, BLOCK_K)  # columns sharing a scale
    if FNUZ:
        w = _fnuz(w)
    w = w.to(tl.float32)
    if SCALE_ROWS > 0 and SCALE_COLS == 0:
        s = tl.load(s_ptr + rows, mask=row_mask, other=0.0)
        if FNUZ:
            s = s * 2.0
        w = w * s[:, None]
    elif SCALE_ROWS > 0:
        column = (k0 + tl.arange(0, BLOCK_K // GROUP) * GROUP) // SCALE_COLS
        s = tl.load(
            s_ptr + (rows // SCALE_ROWS)[:, None] * stride_sn + column[None, :],
            mask=row_mask[:, None] & (column < tl.cdiv(K, SCALE_COLS))[None, :],
            other=0.0,
        )
        if FNUZ:
            s = s * 2.0
        w = tl.reshape(tl.reshape(w, (BLOCK_N, BLOCK_K // GROUP, GROUP)) * s[:, :, None], (BLOCK_N, BLOCK_K))
    return w


@triton.jit
def _fnuz(bits):
    """e4m3fn values, given as their bits (uint8), as e4m3fnuz values of half their size: the encodings share their
    bits but fnuz's exponent bias is one higher (the caller doubles the scales). 0x80, e4m3fn's -0 but fnuz's NaN,
    becomes 0 (as omnirun.devices.rocm.fnuz converts linear weights). An MI300 (CDNA3) converts fnuz natively and
    OCP e4m3fn only in software (Triton's AMD backend, triton/backends/amd/compiler.py: HIPOptions)."""
    return tl.where(bits == 0x80, 0, bits).to(tl.uint8).to(tl.float8e4b8, bitcast=True)


@triton.jit(do_not_specialize=["num_slots"])
def _grouped_gemm_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    weights_ptr,
    sorted_slots_ptr,
    block_experts_ptr,
    total_ptr,
    num_slots,
    N,
    K,
    stride_am,
    stride_be,
    stride_bn,
    stride_cm,
    s_ptr,
    stride_se,
    stride_sn,
    z_ptr,  # int4 weights' zero points (as the scales); None for others
    SLOTS_PER_ROW: tl.constexpr,  # a row of `a` feeds this many slots (top_k for the tokens, 1 for the slots)
    MUL_WEIGHTS: tl.constexpr,
    IEEE: tl.constexpr,  # float32 inputs: exact products (no tf32)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SCALE_ROWS: tl.constexpr = 0,  # fp8 weights: see _widened
    SCALE_COLS: tl.constexpr = 0,
    FNUZ: tl.constexpr = False,  # fp8 weights given as e4m3fn bits, read as e4m3fnuz (see _fnuz)
    INT4_GROUP: tl.constexpr = 0,  # int4 weights (b: their words [E, N, K / 8]): inputs per scale; 0: others
    MAGIC_16: tl.constexpr = 0,  # int4: int4_linear's magic number of a's dtype (16-bit), as bits
):
    pid_m = tl.program_id(0)
    if pid_m * BLOCK_M >= tl.load(total_ptr):
        return
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    slots = tl.load(sorted_slots_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = slots < num_slots  # the padding of an expert's run
    rows = (slots // SLOTS_PER_ROW).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(
            a_ptr + rows[:, None] * stride_am + offs_k[None, :],
            mask=valid[:, None] & (offs_k[None, :] < K),
            other=0.0,
        )
        if INT4_GROUP > 0:  # int4: a step lies in one group: the dot takes q - z exactly, the scale its product
            n_mask = offs_n < N
            offs_w = k0 // 8 + tl.arange(0, BLOCK_K // 8)
            words = tl.load(
                b_ptr + expert * stride_be + offs_n[:, None].to(tl.int64) * stride_bn + offs_w[None, :],
                mask=n_mask[:, None] & (offs_w * 8 < K)[None, :],
                other=0,
            )
            at = expert * stride_se + offs_n.to(tl.int64) * stride_sn + k0 // INT4_GROUP
            s = tl.load(s_ptr + at, mask=n_mask, other=0.0)
            z = tl.load(z_ptr + at, mask=n_mask, other=0).to(tl.int32)
            acc += _dot_nibbles(a, words, z, MAGIC_16) * s[None, :]
        else:
            if SCALE_ROWS > 0:  # fp8: widened and scaled in registers, then rounded to a's dtype as at load
                w = tl.load(
                    b_ptr + expert * stride_be + offs_n[:, None].to(tl.int64) * stride_bn + offs_k[None, :],
                    mask=(offs_n[:, None] < N) & (offs_k[None, :] < K),
                    other=0.0,
                )
                scaled = _widened(w, s_ptr + expert * stride_se, offs_n, offs_n < N, k0, K, stride_sn, BLOCK_N,
                                  BLOCK_K, SCALE_ROWS, SCALE_COLS, FNUZ)  # fmt: skip
                b = tl.trans(scaled.to(a_ptr.dtype.element_ty))
            else:
                b = tl.load(
                    b_ptr + expert * stride_be + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None],
                    mask=(offs_n[None, :] < N) & (offs_k[:, None] < K),
                    other=0.0,
                )
            if INTERPRETED:  # the interpreter's dot multiplies 16-bit floats' raw bits: give it float32
                acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
            elif IEEE:
                acc += tl.dot(a, b, input_precision="ieee")
            else:
                acc += tl.dot(a, b)
    if MUL_WEIGHTS:
        acc *= tl.load(weights_ptr + slots, mask=valid, other=0.0)[:, None]
    out = c_ptr + slots[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    tl.store(out, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & (offs_n[None, :] < N))


@triton.jit
def _route_kernel(
    logits_ptr,
    weights_ptr,
    ids_ptr,
    E,
    stride_l,
    TOP_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_TOP: tl.constexpr,
):
    """One token's top_k experts by softmax(logits) in float32; of equal probabilities the first expert wins."""
    token = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    logits = tl.load(logits_ptr + token * stride_l + offs, mask=offs < E, other=-float("inf")).to(tl.float32)
    probs = tl.exp(logits - tl.max(logits, 0))
    probs = tl.where(offs < E, probs / tl.sum(probs, 0), -1.0)  # -1: never chosen
    top = tl.arange(0, BLOCK_TOP)
    weights = tl.zeros((BLOCK_TOP,), dtype=tl.float32)
    ids = tl.zeros((BLOCK_TOP,), dtype=tl.int64)
    for k in tl.static_range(TOP_K):
        best = tl.max(probs, 0)
        expert = tl.min(tl.where(probs == best, offs, BLOCK_E), 0)
        weights = tl.where(top == k, best, weights)
        ids = tl.where(top == k, expert, ids)
        probs = tl.where(offs == expert, -1.0, probs)
    if RENORMALIZE:
        weights = weights / tl.sum(weights, 0)
    tl.store(weights_ptr + token * TOP_K + top, weights, mask=top < TOP_K)
    tl.store(ids_ptr + token * TOP_K + top, ids, mask=top < TOP_K)


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """omnirun.layers.native_ops.route in one launch: (float32 weights, int64 expert ids), both [T, top_k]."""
    tokens, experts = router_logits.shape
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int64, device=router_logits.device)
    if tokens:
        _route_kernel[(tokens,)](
            router_logits,
            weights,
            ids,
            experts,
            router_logits.stride(0),
            TOP_K=top_k,
            RENORMALIZE=renormalize,
            BLOCK_E=triton.next_power_of_2(experts),
            BLOCK_TOP=triton.next_power_of_2(top_k),
        )
    return weights, ids


@triton.jit
def _slot_gate_up_kernel(
    x_ptr,
    w13_ptr,
    ids_ptr,
    act_ptr,
    expert_start,
    num_local,
    inter,
    K,
    stride_xm,
    stride_we,
    stride_wn,
    s_ptr,
    stride_se,
    stride_sn,
    TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SCALE_ROWS: tl.constexpr = 0,  # fp8 weights: see _widened
    SCALE_COLS: tl.constexpr = 0,
    FNUZ: tl.constexpr = False,  # fp8 weights given as e4m3fn bits, read as e4m3fnuz (see _fnuz)
):
    """act[slot, n] = silu(gate) * up of the slot's token through its expert's rows n and inter + n, in float32."""
    slot = tl.program_id(0).to(tl.int64)
    expert = tl.load(ids_ptr + slot) - expert_start
    if (expert < 0) | (expert >= num_local):  # another rank's expert: its down projection skips the slot too
        return
    x_row = x_ptr + (slot // TOP_K) * stride_xm
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = w13_ptr + expert * stride_we + offs_n[:, None].to(tl.int64) * stride_wn
    gate = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_row + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)[None, :]
        n_mask = offs_n < inter
        mask = n_mask[:, None] & (offs_k[None, :] < K)
        g = tl.load(rows + offs_k[None, :], mask=mask, other=0.0)
        u = tl.load(rows + inter * stride_wn + offs_k[None, :], mask=mask, other=0.0)
        scales = s_ptr + expert * stride_se
        gate += _widened(g, scales, offs_n, n_mask, k0, K, stride_sn, BLOCK_N, BLOCK_K, SCALE_ROWS, SCALE_COLS,
                         FNUZ) * x  # fmt: skip
        up += _widened(u, scales, offs_n + inter, n_mask, k0, K, stride_sn, BLOCK_N, BLOCK_K, SCALE_ROWS,
                       SCALE_COLS, FNUZ) * x  # fmt: skip
    g, u = tl.sum(gate, 1), tl.sum(up, 1)
    tl.store(act_ptr + slot * inter + offs_n, g * tl.sigmoid(g) * u, mask=offs_n < inter)


@triton.jit
def _token_down_kernel(
    act_ptr,
    w2_ptr,
    ids_ptr,
    weights_ptr,
    out_ptr,
    expert_start,
    num_local,
    N,
    K,
    stride_we,
    stride_wn,
    stride_om,
    s_ptr,
    stride_se,
    stride_sn,
    TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SCALE_ROWS: tl.constexpr = 0,  # fp8 weights: see _widened
    SCALE_COLS: tl.constexpr = 0,
    FNUZ: tl.constexpr = False,  # fp8 weights given as e4m3fn bits, read as e4m3fnuz (see _fnuz)
):
    """out[token, n] = sum over the token's slots of weight * (w2[expert] row n . act[slot]), in float32."""
    token = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        slot = token * TOP_K + k
        expert = tl.load(ids_ptr + slot) - expert_start
        if (expert >= 0) & (expert < num_local):
            weight = tl.load(weights_ptr + slot)
            rows = w2_ptr + expert * stride_we + offs_n[:, None].to(tl.int64) * stride_wn
            for k0 in range(0, K, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                a = tl.load(act_ptr + slot * K + offs_k, mask=offs_k < K, other=0.0) * weight
                n_mask = offs_n < N
                w = tl.load(rows + offs_k[None, :], mask=n_mask[:, None] & (offs_k[None, :] < K), other=0.0)
                acc += _widened(w, s_ptr + expert * stride_se, offs_n, n_mask, k0, K, stride_sn, BLOCK_N, BLOCK_K,
                                SCALE_ROWS, SCALE_COLS, FNUZ) * a[None, :]  # fmt: skip
    tl.store(out_ptr + token * stride_om + offs_n, tl.sum(acc, 1).to(out_ptr.dtype.element_ty), mask=offs_n < N)


@triton.jit
def _slot_gate_up_int4_kernel(
    x_ptr,
    w13_ptr,
    s_ptr,
    z_ptr,
    ids_ptr,
    act_ptr,
    expert_start,
    num_local,
    tokens,
    inter,
    K,
    stride_xm,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    nibble_mask,  # 0xF (see int4_linear's GEMV)
    TOP_K: tl.constexpr,
    GROUP: tl.constexpr,  # inputs per scale: a multiple of 8 that divides BLOCK_K or is a multiple of it
    EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """_slot_gate_up_kernel on experts kept in 4 bits: the products of int4_linear's one-row GEMV (each thread sums
    the eight products of each word it holds, scaled by its group's, and the threads' sums meet after the last
    step), for the gate rows and the up rows of the slot's expert."""
    SPAN: tl.constexpr = GROUP if GROUP < BLOCK_K else BLOCK_K
    GROUPS: tl.constexpr = BLOCK_K // SPAN
    slot = tl.program_id(0).to(tl.int64)
    expert = tl.load(ids_ptr + slot) - expert_start
    if (expert < 0) | (expert >= num_local):  # another rank's expert: its down projection skips the slot too
        return
    words_ptr, scales, zeros = w13_ptr + expert * stride_we, s_ptr + expert * stride_se, z_ptr + expert * stride_se
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < inter
    gate = tl.zeros([BLOCK_N, GROUPS, SPAN // 8], dtype=tl.float32)
    up = tl.zeros([BLOCK_N, GROUPS, SPAN // 8], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = (k0 // 8 + tl.arange(0, BLOCK_K // 8))[:, None] * 8 + tl.arange(0, 8)[None, :]
        x = _load_row(x_ptr, slot // TOP_K, tokens, stride_xm, kk, K, EVEN_K)
        words, s, z = _int4_step(words_ptr, scales, zeros, offs_n, n_mask, k0, K, stride_wn, stride_sn, GROUP,
                                 BLOCK_K, EVEN_K)  # fmt: skip
        gate += _row_part(words, x, s, z, nibble_mask, GROUPS, SPAN)
        words, s, z = _int4_step(words_ptr, scales, zeros, offs_n + inter, n_mask, k0, K, stride_wn, stride_sn, GROUP,
                                 BLOCK_K, EVEN_K)  # fmt: skip
        up += _row_part(words, x, s, z, nibble_mask, GROUPS, SPAN)
    g, u = tl.sum(tl.sum(gate, axis=2), axis=1), tl.sum(tl.sum(up, axis=2), axis=1)
    tl.store(act_ptr + slot * inter + offs_n, g * tl.sigmoid(g) * u, mask=n_mask)


@triton.jit
def _token_down_int4_kernel(
    act_ptr,
    w2_ptr,
    s_ptr,
    z_ptr,
    ids_ptr,
    weights_ptr,
    out_ptr,
    expert_start,
    num_local,
    N,
    K,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_om,
    nibble_mask,  # 0xF (see int4_linear's GEMV)
    TOP_K: tl.constexpr,
    GROUP: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """_token_down_kernel on experts kept in 4 bits, with the one-row GEMV's products (see
    _slot_gate_up_int4_kernel): each slot's activations times its routing weight through its expert's rows."""
    SPAN: tl.constexpr = GROUP if GROUP < BLOCK_K else BLOCK_K
    GROUPS: tl.constexpr = BLOCK_K // SPAN
    token = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    acc = tl.zeros([BLOCK_N, GROUPS, SPAN // 8], dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        slot = token * TOP_K + k
        expert = tl.load(ids_ptr + slot) - expert_start
        if (expert >= 0) & (expert < num_local):
            weight = tl.load(weights_ptr + slot)
            words_ptr = w2_ptr + expert * stride_we
            scales, zeros = s_ptr + expert * stride_se, z_ptr + expert * stride_se
            for k0 in range(0, K, BLOCK_K):
                kk = (k0 // 8 + tl.arange(0, BLOCK_K // 8))[:, None] * 8 + tl.arange(0, 8)[None, :]
                a = _load_row(act_ptr, slot, slot + 1, K, kk, K, EVEN_K) * weight  # act [slots, K]: row `slot`
                words, s, z = _int4_step(words_ptr, scales, zeros, offs_n, n_mask, k0, K, stride_wn, stride_sn, GROUP,
                                         BLOCK_K, EVEN_K)  # fmt: skip
                acc += _row_part(words, a, s, z, nibble_mask, GROUPS, SPAN)
    out = tl.sum(tl.sum(acc, axis=2), axis=1)
    tl.store(out_ptr + token * stride_om + offs_n, out.to(out_ptr.dtype.element_ty), mask=n_mask)


@dataclasses.dataclass(frozen=True)
class _Scales:
    """A weight's fp8 scales, or int4 scales and zero points, as the kernels take them: the tensors (one slab per
    expert), and SCALE_ROWS / SCALE_COLS and FNUZ (see _widened) or INT4_GROUP (see _grouped_gemm_kernel). `PLAIN`
    stands for weights in the model dtype."""

    tensor: torch.Tensor | None
    rows: int = 0
    cols: int = 0
    zeros: torch.Tensor | None = None  # int4: uint8 zero points, shaped (and so strided) as `tensor`
    group: int = 0  # int4: inputs per scale; 0: not int4
    fnuz: bool = False  # fp8: the weights' e4m3fn bits are read as e4m3fnuz (see _fnuz)

    @classmethod
    def of(cls, scale: torch.Tensor, block: tuple[int, int] | None, fnuz: bool = False) -> _Scales:
        rows, cols = (1, 0) if block is None else block
        return cls(scale.contiguous(), rows, cols, fnuz=fnuz)

    @classmethod
    def int4(cls, scale: torch.Tensor, zero_point: torch.Tensor, group_size: int, inputs: int) -> _Scales:
        """An int4 weight's [n, N, groups] scales and zero points over groups of `group_size` of its `inputs` (-1:
        one group; a power of two at least `inputs` stands for it, so that every input lies in group 0)."""
        if scale.shape != zero_point.shape:
            raise ValueError(f"int4 scales {tuple(scale.shape)} and zero points {tuple(zero_point.shape)} differ")
        group = triton.next_power_of_2(inputs) if group_size == -1 else group_size
        return cls(scale.contiguous(), zeros=zero_point.contiguous(), group=group)

    @property
    def fp8(self) -> bool:
        return self.tensor is not None and not self.group

    def inputs(self, weight: torch.Tensor) -> int:
        """K of the stacked weight [n, N, K]: eight a word of int4's."""
        return weight.shape[2] * 8 if self.group else weight.shape[2]

    def block_k(self, block_k: int) -> int:
        """The grouped GEMMs' K step for this weight: an int4 step must lie in one group (its scale multiplies the
        step's product), so a longer one is halved until it divides the group (int4_fused_moe takes groups of
        multiples of 16 only: tl.dot's least K)."""
        return k_step(self.group, block_k) if self.group else block_k

    def args(self, weight: torch.Tensor) -> tuple[torch.Tensor, int, int, torch.Tensor | None]:
        """(pointer, stride per expert, stride per row of blocks, int4 zero points or None); a plain weight passes
        itself, never read."""
        if self.tensor is None:
            return weight, 0, 0, None
        stride_sn = self.tensor.stride(1) if self.tensor.dim() == 3 else 0
        return self.tensor, self.tensor.stride(0), stride_sn, self.zeros

    def constexprs(self, dtype: torch.dtype) -> dict[str, int]:
        """The grouped GEMM's constexprs for this weight and activations of `dtype`."""
        if self.group:
            return {"INT4_GROUP": self.group, "MAGIC_16": _MAGIC_16.get(dtype, 0)}
        return {"SCALE_ROWS": self.rows, "SCALE_COLS": self.cols, "FNUZ": self.fnuz}


PLAIN = _Scales(None)


def _moe_by_slot(x, weights, experts, w13, w2, top_k, expert_start, tiles: MoeTiles, s13=PLAIN, s2=PLAIN):
    """The decode path: a GEMV per slot for gate|up and the activation, then one per token for the weighted down
    projections, with no sort; another rank's slots are skipped, not multiplied by zero. fp8 experts (scales given)
    take the table's fp8 tiles (`fp8_decode`, else `decode`'s); int4 experts their own kernels and tiles
    (`int4_decode`, else DEFAULT's)."""
    if s13.group:
        return _int4_by_slot(x, weights, experts, w13, w2, top_k, expert_start, tiles, s13, s2)
    tokens, hidden = x.shape
    local, inter = w13.shape[0], w2.shape[2]
    act = torch.empty(tokens * top_k, inter, dtype=torch.float32, device=x.device)
    bucket = tiles.slot_tiles(tokens * top_k, "fp8" if s13.fp8 else "plain")
    block_n, block_k, num_warps = bucket.gate_up
    scale, stride_se, stride_sn, _ = s13.args(w13)
    _slot_gate_up_kernel[(tokens * top_k, triton.cdiv(inter, block_n))](
        x, w13, experts, act, expert_start, local, inter, hidden, x.stride(0), w13.stride(0), w13.stride(1),
        scale, stride_se, stride_sn, TOP_K=top_k, BLOCK_N=block_n, BLOCK_K=block_k, SCALE_ROWS=s13.rows,
        SCALE_COLS=s13.cols, FNUZ=s13.fnuz, num_warps=num_warps,
    )  # fmt: skip
    out = torch.empty_like(x)
    block_n, block_k, num_warps = bucket.down
    scale, stride_se, stride_sn, _ = s2.args(w2)
    _token_down_kernel[(tokens, triton.cdiv(hidden, block_n))](
        act, w2, experts, weights, out, expert_start, local, hidden, inter, w2.stride(0), w2.stride(1),
        out.stride(0), scale, stride_se, stride_sn, TOP_K=top_k, BLOCK_N=block_n, BLOCK_K=block_k,
        SCALE_ROWS=s2.rows, SCALE_COLS=s2.cols, FNUZ=s2.fnuz, num_warps=num_warps,
    )  # fmt: skip
    return out


def _int4_by_slot(x, weights, experts, w13, w2, top_k, expert_start, tiles: MoeTiles, s13, s2):
    """The decode path on experts kept in 4 bits (int4_linear's GEMV products), each K step lowered to fit the
    groups (int4_linear.k_step)."""
    tokens, hidden = x.shape
    local, inter = w13.shape[0], s2.inputs(w2)
    act = torch.empty(tokens * top_k, inter, dtype=torch.float32, device=x.device)
    bucket = tiles.slot_tiles(tokens * top_k, "int4")
    block_n, block_k, num_warps = bucket.gate_up
    block_k = k_step(s13.group, block_k, rows=1)
    _slot_gate_up_int4_kernel[(tokens * top_k, triton.cdiv(inter, block_n))](
        x, w13, s13.tensor, s13.zeros, experts, act, expert_start, local, tokens, inter, hidden, x.stride(0),
        w13.stride(0), w13.stride(1), s13.tensor.stride(0), s13.tensor.stride(1), 0xF, TOP_K=top_k, GROUP=s13.group,
        EVEN_K=hidden % block_k == 0, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps,
    )  # fmt: skip
    out = torch.empty_like(x)
    block_n, block_k, num_warps = bucket.down
    block_k = k_step(s2.group, block_k, rows=1)
    _token_down_int4_kernel[(tokens, triton.cdiv(hidden, block_n))](
        act, w2, s2.tensor, s2.zeros, experts, weights, out, expert_start, local, hidden, inter, w2.stride(0),
        w2.stride(1), s2.tensor.stride(0), s2.tensor.stride(1), out.stride(0), 0xF, TOP_K=top_k, GROUP=s2.group,
        EVEN_K=inter % block_k == 0, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps,
    )  # fmt: skip
    return out


def sort_slots(
    experts: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Slots (flattened [T, top_k] expert choices) sorted by expert, each expert's run padded to whole blocks of
    block_m (padding: the slot count, past every slot). An expert id of num_experts marks a slot this rank does not
    compute (another rank's expert): those sort last, past the total. Returns (sorted slots [capacity], each block's
    expert [capacity / block_m], the padded total of this rank's runs [1]), all on the device, capacity fixed by T
    alone."""
    flat = experts.flatten()
    slots = flat.numel()
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # (bincount would read the maximum on the host)
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    order = torch.sort(flat, stable=True).indices
    by_expert = flat[order]
    rank = torch.arange(slots, device=flat.device) - (counts.cumsum(0) - counts)[by_expert]
    capacity = triton.cdiv(slots + (num_experts + 1) * (block_m - 1), block_m) * block_m
    sorted_slots = torch.full((capacity,), slots, dtype=torch.int64, device=flat.device)
    sorted_slots[(padded_end - padded)[by_expert] + rank] = order
    starts = torch.arange(0, capacity, block_m, device=flat.device)
    block_experts = torch.searchsorted(padded_end, starts, right=True).clamp(max=num_experts - 1)
    return sorted_slots, block_experts, padded_end[num_experts - 1 : num_experts]


def _grouped_gemm(
    a, b, sorted_slots, block_experts, total, num_slots, slots_per_row, weights, out_dtype, tile, skips=False,
    scales=PLAIN,
):  # fmt: skip
    """out[slot] = a[slot // slots_per_row] @ b[expert of slot].T (x the slot's weight), for every slot this rank
    computes; with `skips`, the rows of the slots it skips are zeros."""
    n, k = b.shape[1], scales.inputs(b)
    out = (torch.zeros if skips else torch.empty)(num_slots, n, dtype=out_dtype, device=a.device)
    block_m, block_n, block_k, num_warps, num_stages = tile
    block_k = scales.block_k(block_k)
    grid = (block_experts.numel(), triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a,
        b,
        out,
        weights if weights is not None else out,
        sorted_slots,
        block_experts,
        total,
        num_slots,
        n,
        k,
        a.stride(0),
        b.stride(0),
        b.stride(1),
        out.stride(0),
        *scales.args(b),
        SLOTS_PER_ROW=slots_per_row,
        MUL_WEIGHTS=weights is not None,
        IEEE=a.dtype == torch.float32,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=num_warps,
        num_stages=num_stages,
        **scales.constexprs(a.dtype),
    )
    return out


def fused_moe(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    renormalize: bool,
    expert_start: int = 0,
    tiles: MoeTiles = DEFAULT,
) -> torch.Tensor:
    """See omnirun.layers.native_ops.fused_moe (the reference): the same mixture, summed per token over its top_k
    choices (in float32, rounded once) rather than expert by expert. A few slots take the decode path, more the
    grouped GEMMs, with the device's `tiles` (omnirun.kernels.triton.moe_tiles); on either, slots routed to another
    rank's experts (expert parallelism) are skipped."""
    from omnirun.layers import native_ops

    if x.dtype not in _KERNEL_DTYPES or w13.dtype != x.dtype or w2.dtype != x.dtype or x.dim() != 2:
        return native_ops.fused_moe(x, router_logits, w13, w2, top_k, renormalize, expert_start)
    return _mixture(x, router_logits, w13, w2, top_k, renormalize, expert_start, tiles, PLAIN, PLAIN)


def fp8_fused_moe(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    top_k: int,
    renormalize: bool,
    expert_start: int = 0,
    block: tuple[int, int] | None = None,
    tiles: MoeTiles = DEFAULT,
    fnuz: bool = False,
) -> torch.Tensor:
    """See omnirun.layers.native_ops.fp8_fused_moe (the reference): `fused_moe` whose kernels read the fp8 experts
    and widen each tile in registers (weight-only: the activations stay in x's dtype), each value times its scale in
    float32; the grouped GEMMs round it to x's dtype before the dot, as dequantizing at load does. Block scales
    need power-of-two block columns (every fp8 checkpoint's 128), else the reference runs. `fnuz`: the kernels read
    the e4m3fn experts' bits as e4m3fnuz, the encoding an MI300 converts natively, and double the scales (_fnuz):
    the same values, exactly."""
    from omnirun.layers import native_ops

    plain = x.dtype not in _KERNEL_DTYPES or x.dim() != 2 or w13.dtype != torch.float8_e4m3fn
    if plain or w2.dtype != torch.float8_e4m3fn or (block is not None and block[1] & (block[1] - 1)):
        return native_ops.fp8_fused_moe(
            x, router_logits, w13, w13_scale, w2, w2_scale, top_k, renormalize, expert_start, block
        )
    s13, s2 = _Scales.of(w13_scale, block, fnuz), _Scales.of(w2_scale, block, fnuz)
    if fnuz:
        w13, w2 = w13.view(torch.uint8), w2.view(torch.uint8)
    return _mixture(x, router_logits, w13, w2, top_k, renormalize, expert_start, tiles, s13, s2)


def int4_fused_moe(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    w13_packed: torch.Tensor,
    w13_scale: torch.Tensor,
    w13_zero_point: torch.Tensor,
    w2_packed: torch.Tensor,
    w2_scale: torch.Tensor,
    w2_zero_point: torch.Tensor,
    top_k: int,
    renormalize: bool,
    expert_start: int = 0,
    group_size: int = 128,
    prepared: Any = None,
    tiles: MoeTiles = DEFAULT,
) -> torch.Tensor:
    """See omnirun.layers.native_ops.int4_fused_moe (the reference; Ops.int4_fused_moe has the layouts; `prepared`
    unused: the kernels read the loaded words): `fused_moe`
    whose kernels read the experts' int32 words (weight-only: the activations stay in x's dtype) and multiply by
    q - zero, each group's partial product then by its scale, in float32 (the reference dequantizes to x's dtype
    first: the two round differently, within x's precision). Groups of a multiple of 16 inputs (every checkpoint's
    32, 64 or 128) or -1, else the reference runs."""
    from omnirun.layers import native_ops

    if x.dtype not in _KERNEL_DTYPES or x.dim() != 2 or (group_size != -1 and (group_size <= 0 or group_size % 16)):
        return native_ops.int4_fused_moe(
            x, router_logits, w13_packed, w13_scale, w13_zero_point, w2_packed, w2_scale, w2_zero_point, top_k,
            renormalize, expert_start, group_size,
        )  # fmt: skip
    s13 = _Scales.int4(w13_scale, w13_zero_point, group_size, w13_packed.shape[2] * 8)
    s2 = _Scales.int4(w2_scale, w2_zero_point, group_size, w2_packed.shape[2] * 8)
    return _mixture(x, router_logits, w13_packed, w2_packed, top_k, renormalize, expert_start, tiles, s13, s2)


def _mixture(x, router_logits, w13, w2, top_k, renormalize, expert_start, tiles, s13, s2):
    """The mixture on either path, the experts' weights plain, fp8 with their scales, or int4 words with their scales
    and zero points."""
    tokens = x.shape[0]
    if tokens == 0:
        return torch.zeros_like(x)
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    weights, experts = route(router_logits, top_k, renormalize)
    slots = tokens * top_k
    if tiles.by_slot(slots, w13.shape[0], "int4" if s13.group else "plain"):
        return _moe_by_slot(x, weights, experts, w13, w2, top_k, expert_start, tiles, s13, s2)
    local = w13.shape[0]
    foreign = local != router_logits.shape[-1]
    if foreign:  # expert parallelism: this rank holds experts expert_start.. only, and skips the other slots
        experts = experts - expert_start
        experts = torch.where((experts >= 0) & (experts < local), experts, local)
    tile = tiles.grouped_tile(slots, local, "int4" if s13.group else "plain")
    sorted_slots, block_experts, total = sort_slots(experts, local, tile[0])
    gate_up = _grouped_gemm(x, w13, sorted_slots, block_experts, total, slots, top_k, None, x.dtype, tile, scales=s13)
    gate, up = gate_up.chunk(2, dim=-1)
    hidden = (F.silu(gate) * up).contiguous()
    weighted = _grouped_gemm(
        hidden, w2, sorted_slots, block_experts, total, slots, 1, weights.flatten(), torch.float32, tile, foreign, s2
    )
    return weighted.view(tokens, top_k, -1).sum(dim=1).to(x.dtype)
