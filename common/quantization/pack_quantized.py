"""compressed-tensors' integer formats: "pack-quantized" (llm-compressor's W4A16 and W8A16: integer weights packed
into int32 words, read as compressed-tensors' PackedQuantizationCompressor writes them) and "int-quantized" (its W8A8:
int8 weights as they are, IntQuantizationCompressor).

Per quantized layer: `weight_packed` int32 [N, ceil(K / per_word)] holds each row's consecutive inputs, the lowest
bits first (per_word = 32 / num_bits), each value stored plus 2^(num_bits - 1) (unsigned); `weight_shape` [2] the
unpacked [N, K]; `weight_scale` [N, K / group_size] (strategy "group") or [N, 1] ("channel"); `weight_zero_point`
when the scheme is asymmetric, packed the same way along the output rows, [ceil(N / per_word), groups]; and
`weight_g_idx` [K], each input's group, when `actorder` is "group". weight[n, k] = (q - zero) x scale of k's group.
Activations stay in the model dtype (no `input_activations`).

Where the platform runs `int4_linear`, 4-bit pack-quantized layers whose groups are consecutive inputs (no g_idx)
are kept packed in its layout (omnirun.layers.linear.Int4Weights), as AWQ's and GPTQ's are: the stored unsigned values
and zero points (8 where symmetric) as they are, since (q + 8) - (zero + 8) = q - zero. The rest are dequantized at
load.

int-quantized: `weight` int8 [N, K] itself, `weight_scale` [N, 1] (channel), [N, groups] (group) or one value
(tensor), `weight_zero_point` int8 of the scale's shape when asymmetric. Its activation scheme (int8 per token) is
read and not used: the weights are dequantized at load and the layers compute in the model dtype.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from omnirun.errors import ModelLoadError
from omnirun.layers.linear import Int4Weights, QuantizedOf, full_precision
from omnirun.layers.ops import Ops, runs_int4_weights
from omnirun.quantization.int4 import kept_int4, listed, unpack

_PACKED_PARTS = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx")
_INT_PARTS = ("weight", "weight_scale", "weight_zero_point", "weight_g_idx")


@dataclasses.dataclass(frozen=True)
class PackedIntFormat:
    bits: int
    group_size: int | None  # None: one scale per output channel (or per tensor, when the checkpoint has one)
    symmetric: bool
    g_idx: bool  # actorder "group": each input's group is saved
    packed: bool = True  # pack-quantized; False: int-quantized (int8 weights as they are)
    ignored: tuple[str, ...] = ()  # the config's `ignore`: modules saved unquantized

    @classmethod
    def from_weights(cls, group: str, weights: dict[str, Any], packed: bool = True) -> PackedIntFormat:
        """From one config group's `weights` (compressed-tensors' QuantizationArgs)."""
        bits, strategy = weights.get("num_bits"), weights.get("strategy")
        allowed_bits, allowed = ((4, 8), ("group", "channel")) if packed else ((8,), ("group", "channel", "tensor"))
        if weights.get("type") != "int" or bits not in allowed_bits:
            raise ModelLoadError(
                f"compressed-tensors group {group!r} packs {bits}-bit {weights.get('type')} weights: omnirun loads "
                "4- and 8-bit int weights in the pack-quantized format, 8-bit in the int-quantized one"
            )
        if strategy not in allowed:
            raise ModelLoadError(
                f"compressed-tensors group {group!r} has int weight strategy {strategy!r}: expected "
                f"{' or '.join(allowed)}"
            )
        size = weights.get("group_size") if strategy == "group" else None
        if strategy == "group" and (not isinstance(size, int) or size <= 0):
            raise ModelLoadError(f"compressed-tensors group {group!r} has group_size {size!r}: expected an int > 0")
        actorder = weights.get("actorder")
        if actorder not in (None, False, "group", "weight", True):
            raise ModelLoadError(
                f"compressed-tensors group {group!r} has actorder {actorder!r}: expected group, weight or none"
            )
        return cls(bits, size, bool(weights.get("symmetric", True)), actorder in ("group", True), packed)

    def describe(self) -> str:
        grouping = f"group {self.group_size}" if self.group_size else "per channel"
        packing = "" if self.packed else " (int-quantized)"
        return f"compressed-tensors int{self.bits} {grouping}{'' if self.symmetric else ' asymmetric'}{packing}"

    def layer_of(self, name: str, dtype: torch.dtype) -> str | None:
        layer, _, part = name.rpartition(".")
        if not self.packed and part == "weight":
            return layer if dtype == torch.int8 else None  # an ignored layer's float weight loads as it is
        return layer if part in (_PACKED_PARTS if self.packed else _INT_PARTS) else None

    def part_names(self, layer: str) -> tuple[str, ...]:
        parts = ["weight_packed", "weight_scale", "weight_shape"] if self.packed else ["weight", "weight_scale"]
        parts += [] if self.symmetric else ["weight_zero_point"]
        parts += ["weight_g_idx"] if self.g_idx else []
        return tuple(f"{layer}.{part}" for part in parts)

    def dropped(self, name: str) -> bool:
        return False

    def quantizes(self, module: str) -> bool:
        """Whether the checkpoint holds `module` (an HF module name) quantized: not in the config's ignore list."""
        return not listed(module, self.ignored)

    def kept_by(self, ops: Ops) -> bool:
        """Whether layers keep these weights packed on a platform of this op table: 4-bit pack-quantized weights in
        groups of consecutive inputs, where it runs `int4_linear`."""
        return self._keepable and runs_int4_weights(ops)

    def quantized_of(self) -> QuantizedOf:
        """The layers that keep this checkpoint's weights packed: every linear layer whose modules it quantizes, for
        4-bit pack-quantized weights without g_idx; else none."""
        if not self._keepable:
            return full_precision
        weights = Int4Weights(self.group_size or -1)  # per channel: one group over the whole input
        return lambda modules: weights if all(self.quantizes(m) for m in modules) else None

    @property
    def _keepable(self) -> bool:
        return self.packed and self.bits == 4 and not self.g_idx

    def kept(self, parts: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """The layer's parameters in the kept layout (omnirun.layers.linear.Int4Weights)."""
        q, zero, scale, _ = self._unpacked(parts)
        return kept_int4(q, zero, scale)

    def dequantize(self, parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        q, zero, scale, group = self._unpacked(parts)
        return ((q - zero[:, group]).float() * scale[:, group].float()).to(dtype)

    def _unpacked(self, parts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q int32 [N, K], zero int32 [N, groups], scale [N, groups], each input's group [K]), checked against each
        other; packed values and zero points as stored (unsigned), int-quantized ones signed."""
        offset = 1 << (self.bits - 1)
        if self.packed:
            packed, scale, shape, *rest = parts
            rows, columns = (int(n) for n in shape.tolist())
            q = unpack(packed, self.bits, dim=1)[:, :columns]  # [N, K], each value + offset
        else:
            weight, scale, *rest = parts
            (rows, columns), q = weight.shape, weight.to(torch.int32)
            if scale.numel() == 1:  # strategy "tensor": one scale (and zero point) for the whole weight
                scale = scale.reshape(1, 1).expand(rows, 1)
        if q.shape[0] != rows or scale.shape[0] != rows:
            raise ModelLoadError(
                f"compressed-tensors int parts disagree: the weight is {[rows, columns]} (unpacked {list(q.shape)}), "
                f"weight_scale is {list(scale.shape)}: re-save the checkpoint"
            )
        if self.symmetric:
            zero = torch.full(scale.shape, offset if self.packed else 0, dtype=torch.int32)
        else:
            stored = rest.pop(0)
            if self.packed:
                zero = unpack(stored, self.bits, dim=0)[:rows]  # [N, groups], each + offset
            else:
                zero = stored.to(torch.int32).reshape(-1, 1).expand(rows, 1) if stored.numel() == 1 else stored
                zero = zero.to(torch.int32)
        if self.g_idx:
            group = rest.pop(0).long()
        elif self.group_size is None:
            group = torch.zeros(columns, dtype=torch.long)
        else:
            group = torch.arange(columns) // self.group_size
        groups = 1 if self.group_size is None else -(-columns // self.group_size)
        if (
            scale.shape[1] != groups
            or zero.shape != scale.shape
            or group.shape != (columns,)
            or group.min() < 0
            or group.max() >= groups
        ):
            raise ModelLoadError(
                f"a compressed-tensors int layer of {columns} inputs has {scale.shape[1]} groups of scales, which its "
                f"group_size ({self.group_size}) or g_idx does not match: re-save the checkpoint"
            )
        return q, zero, scale, group
