"""Integer weights packed into int32 words with per-group scales and zero points, as the two int4 hubs save them:

- AWQ, "gemm" version (AutoAWQ's WQLinear_GEMM, read the same way by vLLM's awq.py): `qweight` int32 [K, N / 8]
  packs 8 output columns per word in the order 0, 2, 4, 6, 1, 3, 5, 7 (nibble i holds column 8c + ORDER[i]);
  `qzeros` int32 [K / G, N / 8] packed alike; `scales` [K / G, N]. weight[k, n] = (q - zero) x scale of group k // G.
- GPTQ (AutoGPTQ / GPTQModel, vLLM's gptq.py): `qweight` int32 [K * bits / 32, N] packs consecutive input rows
  into each word, the lowest bits first; `qzeros` int32 [groups, N * bits / 32] packs consecutive columns;
  `scales` [groups, N]; `g_idx` int32 [K] names each input row's group (act order, `desc_act`, permutes them). The
  "gptq" checkpoint format stores each zero point minus one, "gptq_v2" as it is.

K = in_features, N = out_features, G = group_size (-1: one group over K). The linear layer's weight is [N, K].

Where the platform runs `int4_linear`, 4-bit layers are kept packed instead, both formats converted at load to one
layout (omnirun.layers.linear.Int4Weights: `weight_packed` int32 [N, K / 8] with eight consecutive inputs a word,
the lowest bits first; `weight_scale` float32 and `weight_zero_point` uint8 [N, groups]): one row per output, so
tensor-parallel and fused-shard splits cut rows, and K is cut at whole groups. GPTQ with act order (`desc_act`,
g_idx a permutation of the groups) and 8-bit GPTQ stay dequantized at load: the kept layout has groups of
consecutive inputs.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch

from omnirun.errors import ModelLoadError
from omnirun.layers.linear import Int4Weights, QuantizedOf, full_precision
from omnirun.layers.ops import Ops, runs_int4_weights

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the output column each nibble of an AWQ word holds, within its 8


def unpack(words: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 words -> their `32 // bits` unsigned fields each, laid out along `dim` (lowest bits first, or the field
    holding position j of each run at ORDER's index of j)."""
    per_word = 32 // bits
    shifts = torch.arange(per_word, dtype=torch.int32) * bits
    fields = (words.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., per_word]
    if order is not None:
        fields = fields[..., [order.index(j) for j in range(per_word)]]
    fields = fields.movedim(-1, dim + 1 if dim >= 0 else dim)  # next to the packed dim
    shape = list(words.shape)
    shape[dim] *= per_word
    return fields.reshape(shape)


def pack_int4_rows(values: torch.Tensor) -> torch.Tensor:
    """ints in 0..15 [N, K] (K a multiple of 8) -> int32 [N, K / 8], word c holding inputs 8c..8c+7, the lowest bits
    first (the kept layout; omnirun.layers.native_ops.unpack_int4_rows is its inverse)."""
    rows, columns = values.shape
    if columns % 8:
        raise ModelLoadError(f"a 4-bit layer of {columns} inputs cannot be kept packed: not a multiple of 8")
    fields = values.to(torch.int64).reshape(rows, columns // 8, 8) << (
        4 * torch.arange(8, dtype=torch.int64, device=values.device)
    )
    words = fields.sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def kept_int4(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor) -> dict[str, torch.Tensor]:
    """q in 0..15 [N, K], zeros and scales [N, groups] -> the kept layer's parameters
    (omnirun.layers.linear.Int4Weights)."""
    return {
        "weight_packed": pack_int4_rows(q),
        "weight_scale": scales.float().contiguous(),
        "weight_zero_point": zeros.to(torch.uint8).contiguous(),
    }


def listed(module: str, entries: tuple[str, ...]) -> bool:
    """Whether `module` is named by a list of modules left unquantized (modules_to_not_convert, compressed-tensors'
    ignore): entries match as substrings, as transformers matches them, and "re:" entries as regular expressions
    of the whole name, as compressed-tensors writes them."""
    return any(re.fullmatch(entry[3:], module) if entry.startswith("re:") else entry in module for entry in entries)


def _group_size(quantization: dict[str, Any], key: str) -> int:
    size = quantization.get(key, 128)
    if not isinstance(size, int) or (size <= 0 and size != -1):
        raise ModelLoadError(f"{key} {size!r} is invalid: expected a positive integer or -1")
    return size


def _groups(group_size: int, in_features: int, groups: int, method: str) -> int:
    """The group size over K, checked against the number of groups the scales hold."""
    size = in_features if group_size == -1 else group_size
    if -(-in_features // size) != groups:
        raise ModelLoadError(
            f"a {method} layer of {in_features} inputs in groups of {size} needs {-(-in_features // size)} groups of "
            f"scales, the checkpoint has {groups}: its group_size does not match the weights"
        )
    return size


@dataclasses.dataclass(frozen=True)
class AwqFormat:
    group_size: int
    ignored: tuple[str, ...] = ()  # modules_to_not_convert: left in full precision by the checkpoint

    @classmethod
    def from_config(cls, quantization: dict[str, Any]) -> AwqFormat:
        bits = quantization.get("bits", quantization.get("w_bit", 4))
        version = str(quantization.get("version", "gemm")).lower()
        if bits != 4 or version != "gemm" or not quantization.get("zero_point", True):
            raise ModelLoadError(
                f"AWQ with bits {bits}, version {version!r}, zero_point {quantization.get('zero_point', True)} is not "
                "supported: omnirun loads 4-bit GEMM checkpoints with zero points"
            )
        size = _group_size(quantization, "group_size" if "group_size" in quantization else "q_group_size")
        return cls(size, tuple(quantization.get("modules_to_not_convert") or ()))

    def describe(self) -> str:
        return f"awq int4 group {self.group_size}"

    def layer_of(self, name: str, dtype: torch.dtype) -> str | None:
        layer, _, part = name.rpartition(".")
        return layer if part in ("qweight", "qzeros", "scales") else None

    def part_names(self, layer: str) -> tuple[str, ...]:
        return (f"{layer}.qweight", f"{layer}.qzeros", f"{layer}.scales")

    def dropped(self, name: str) -> bool:
        return False

    def quantizes(self, module: str) -> bool:
        """Whether the checkpoint holds `module` (an HF module name) in 4 bits."""
        return not listed(module, self.ignored)

    def kept_by(self, ops: Ops) -> bool:
        """Whether layers keep these 4-bit weights packed on a platform of this op table (it runs `int4_linear`)."""
        return runs_int4_weights(ops)

    def quantized_of(self) -> QuantizedOf:
        """The layers that keep this checkpoint's 4-bit weights: every linear layer whose modules it quantizes."""
        weights = Int4Weights(self.group_size)
        return lambda modules: weights if all(self.quantizes(m) for m in modules) else None

    def _unpacked(self, parts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """(q [K, N], zeros [groups, N], scales [groups, N], inputs per group), checked against each other."""
        qweight, qzeros, scales = parts
        q = unpack(qweight, 4, dim=1, order=AWQ_ORDER)  # [K, N]
        zeros = unpack(qzeros, 4, dim=1, order=AWQ_ORDER)  # [groups, N]
        if zeros.shape != scales.shape or q.shape[1] != scales.shape[1]:
            raise ModelLoadError(
                f"AWQ parts disagree: qweight unpacks to {list(q.shape)}, qzeros to {list(zeros.shape)}, scales are "
                f"{list(scales.shape)}: re-save the checkpoint"
            )
        return q, zeros, scales, _groups(self.group_size, q.shape[0], scales.shape[0], "AWQ")

    def kept(self, parts: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """The layer's parameters in the kept layout (omnirun.layers.linear.Int4Weights)."""
        q, zeros, scales, _ = self._unpacked(parts)
        return kept_int4(q.t(), zeros.t(), scales.t())

    def dequantize(self, parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        q, zeros, scales, size = self._unpacked(parts)
        group = torch.arange(q.shape[0]) // size
        return ((q - zeros[group]).float() * scales[group].float()).t().to(dtype)


@dataclasses.dataclass(frozen=True)
class GptqFormat:
    bits: int
    group_size: int
    zero_minus_one: bool  # the "gptq" checkpoint format's zero points (stored minus one)
    desc_act: bool = False  # act order: g_idx permutes the groups (dequantized at load, never kept)
    ignored: tuple[str, ...] = ()  # modules_to_not_convert: left in full precision by the checkpoint
    skipped: tuple[str, ...] = ()  # GPTQModel's `dynamic` "-:" rules: regular expressions of modules left out

    @classmethod
    def from_config(cls, quantization: dict[str, Any]) -> GptqFormat:
        bits = quantization.get("bits", 4)
        if bits not in (4, 8):
            raise ModelLoadError(f"GPTQ with bits {bits!r} is not supported: omnirun loads 4- and 8-bit GPTQ")
        checkpoint_format = quantization.get("checkpoint_format", "gptq")
        if checkpoint_format not in ("gptq", "gptq_v2"):
            raise ModelLoadError(
                f"GPTQ checkpoint_format {checkpoint_format!r} is not supported: omnirun loads gptq and gptq_v2"
            )
        dynamic = quantization.get("dynamic") or {}
        return cls(
            bits,
            _group_size(quantization, "group_size"),
            zero_minus_one=checkpoint_format == "gptq",
            desc_act=bool(quantization.get("desc_act", False)),
            ignored=tuple(quantization.get("modules_to_not_convert") or ()),
            skipped=tuple(key[2:] for key in dynamic if key.startswith("-:")),
        )

    def describe(self) -> str:
        return f"gptq int{self.bits} group {self.group_size}"

    def layer_of(self, name: str, dtype: torch.dtype) -> str | None:
        layer, _, part = name.rpartition(".")
        return layer if part in ("qweight", "qzeros", "scales", "g_idx") else None

    def part_names(self, layer: str) -> tuple[str, ...]:
        return (f"{layer}.qweight", f"{layer}.qzeros", f"{layer}.scales", f"{layer}.g_idx")

    def dropped(self, name: str) -> bool:
        return False

    def quantizes(self, module: str) -> bool:
        """Whether the checkpoint holds `module` (an HF module name) quantized (vLLM matches `dynamic`'s "-:" rules
        with re.match)."""
        return not listed(module, self.ignored) and not any(re.match(rule, module) for rule in self.skipped)

    def kept_by(self, ops: Ops) -> bool:
        """Whether layers keep these weights packed on a platform of this op table (it runs `int4_linear`)."""
        return runs_int4_weights(ops)

    def quantized_of(self) -> QuantizedOf:
        """The layers that keep this checkpoint's weights packed: every linear layer whose modules it quantizes, for
        4 bits without act order; else none."""
        if self.bits != 4 or self.desc_act:
            return full_precision
        weights = Int4Weights(self.group_size)
        return lambda modules: weights if all(self.quantizes(m) for m in modules) else None

    def _unpacked(self, parts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q [K, N], zeros [groups, N], scales [groups, N], each input's group [K]), checked against each other."""
        qweight, qzeros, scales, g_idx = parts
        q = unpack(qweight, self.bits, dim=0)  # [K, N]
        zeros = unpack(qzeros, self.bits, dim=1) + int(self.zero_minus_one)  # [groups, N]
        if zeros.shape != scales.shape or q.shape[1] != scales.shape[1] or g_idx.shape != (q.shape[0],):
            raise ModelLoadError(
                f"GPTQ parts disagree: qweight unpacks to {list(q.shape)}, qzeros to {list(zeros.shape)}, scales are "
                f"{list(scales.shape)}, g_idx {list(g_idx.shape)}: re-save the checkpoint"
            )
        group = g_idx.long()
        if group.min() < 0 or group.max() >= scales.shape[0]:
            raise ModelLoadError(f"GPTQ g_idx names groups outside 0..{scales.shape[0] - 1}: re-save the checkpoint")
        return q, zeros, scales, group

    def kept(self, parts: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """The layer's parameters in the kept layout (omnirun.layers.linear.Int4Weights): groups of consecutive
        inputs, which g_idx must say."""
        q, zeros, scales, group = self._unpacked(parts)
        size = _groups(self.group_size, q.shape[0], scales.shape[0], "GPTQ")
        if not torch.equal(group, torch.arange(q.shape[0]) // size):
            raise ModelLoadError(
                "the GPTQ checkpoint's g_idx is in act order though its config says desc_act false: set "
                '"desc_act": true in its quantization_config (such layers are dequantized at load)'
            )
        return kept_int4(q.t(), zeros.t(), scales.t())

    def dequantize(self, parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        q, zeros, scales, group = self._unpacked(parts)
        return ((q - zeros[group]).float() * scales[group].float()).t().to(dtype)
