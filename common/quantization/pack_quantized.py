"""compressed-tensors' integer formats: "pack-quantized" (llm-compressor's W4A16 and W8A16: integer weights packed
into int32 words, read as compressed-tensors' PackedQuantizationCompressor writes them) and "int-quantized" (its W8A8:
int8 weights as they are, IntQuantizationCompressor).

Per quantized layer: `weight_packed` int32 [N, ceil(K / per_word)] holds each row's consecutive inputs, the lowest
bits first (per_word = 32 / num_bits), each value stored plus 2^(num_bits - 1) (unsigned); `weight_shape` [2] the
unpacked [N, K]; `weight_scale` [N, K / group_size] (strategy "group") or [N, 1] ("channel"); `weight_zero_point`
when the scheme is asymmetric, packed the same way along the output rows, [ceil(N / per_word), groups]; and
`weight_g_idx` [K], each input's group, when `actorder` is "group". weight[n, k] = (q - zero) x scale of k's group.
Activations stay in the model dtype (no `input_activations`).

int-quantized: `weight` int8 [N, K] itself, `weight_scale` [N, 1] (channel), [N, groups] (group) or one value
(tensor), `weight_zero_point` int8 of the scale's shape when asymmetric. Its activation scheme (int8 per token) is
read and not used: the weights are dequantized at load and the layers compute in the model dtype.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from omnirun.errors import ModelLoadError
from omnirun.quantization.int4 import unpack

_PACKED_PARTS = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx")
_INT_PARTS = ("weight", "weight_scale", "weight_zero_point", "weight_g_idx")


@dataclasses.dataclass(frozen=True)
class PackedIntFormat:
    bits: int
    group_size: int | None  # None: one scale per output channel (or per tensor, when the checkpoint has one)
    symmetric: bool
    g_idx: bool  # actorder "group": each input's group is saved
    packed: bool = True  # pack-quantized; False: int-quantized (int8 weights as they are)

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

    def dequantize(self, parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        offset = 1 << (self.bits - 1)
        if self.packed:
            packed, scale, shape, *rest = parts
            rows, columns = (int(n) for n in shape.tolist())
            q = unpack(packed, self.bits, dim=1)[:, :columns] - offset  # [N, K]
        else:
            weight, scale, *rest = parts
            (rows, columns), q = weight.shape, weight.to(torch.int32)
            if scale.numel() == 1:  # strategy "tensor": one scale (and zero point) for the whole weight
                scale = scale.reshape(1, 1).expand(rows, 1)
        zero = torch.zeros((), dtype=torch.int32)
        if not self.symmetric:
            stored = rest.pop(0)
            if self.packed:
                zero = unpack(stored, self.bits, dim=0)[:rows] - offset  # [N, groups]
            else:
                zero = (
                    stored.to(torch.int32).reshape(-1, 1).expand(rows, 1)
                    if stored.numel() == 1
                    else stored.to(torch.int32)
                )
        if q.shape[0] != rows or scale.shape[0] != rows:
            raise ModelLoadError(
                f"compressed-tensors int parts disagree: the weight is {[rows, columns]} (unpacked {list(q.shape)}), "
                f"weight_scale is {list(scale.shape)}: re-save the checkpoint"
            )
        if self.g_idx:
            group = rest.pop(0).long()
        elif self.group_size is None:
            group = torch.zeros(columns, dtype=torch.long)
        else:
            group = torch.arange(columns) // self.group_size
        groups = 1 if self.group_size is None else -(-columns // self.group_size)
        if scale.shape[1] != groups or group.shape != (columns,) or group.min() < 0 or group.max() >= groups:
            raise ModelLoadError(
                f"a compressed-tensors int layer of {columns} inputs has {scale.shape[1]} groups of scales, which its "
                f"group_size ({self.group_size}) or g_idx does not match: re-save the checkpoint"
            )
        if not self.symmetric:
            zero = zero[:, group]
        return ((q - zero).float() * scale[:, group].float()).to(dtype)
