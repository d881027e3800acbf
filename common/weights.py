"""Moving weights into a live model: the initial load, updates that roll back on failure, and reads by name.

Names are HF checkpoint names; the model maps each to the parameter rows it fills (`checkpoint_target`), so a
tensor of a fused projection lands in its shard.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import Protocol

import torch

from omnirun.errors import ModelLoadError, WeightUpdateError

logger = logging.getLogger(__name__)


class CheckpointModel(Protocol):
    def checkpoint_target(self, name: str) -> torch.Tensor | None: ...
    def checkpoint_names(self) -> list[str]: ...


def target_for(
    model: CheckpointModel, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None
) -> torch.Tensor | None:
    """The rows `name` fills, checked against the incoming shape (and dtype, when given); ValueError with a one-line
    reason otherwise."""
    try:
        target = model.checkpoint_target(name)
    except KeyError:
        raise ValueError(f"tensor {name!r} is not a parameter of this model") from None
    if target is None:
        return None
    if tuple(target.shape) != tuple(shape):
        raise ValueError(f"tensor {name!r} has shape {list(shape)}, the model expects {list(target.shape)}")
    if dtype is not None and not _castable(dtype, target.dtype):
        raise DtypeMismatch(
            f"tensor {name!r} is stored as {str(dtype).removeprefix('torch.')}, which does not convert to the "
            f"model's {str(target.dtype).removeprefix('torch.')}"
        )
    return target


class DtypeMismatch(ValueError):
    """A checkpoint tensor whose values a cast would not keep (quantized or integer data for float weights)."""

    hint = "omnirun loads float32/float16/bfloat16 weights; dequantize the checkpoint first (or re-save it)"


def _castable(source: torch.dtype, target: torch.dtype) -> bool:
    """Whether copy_ from `source` keeps the values: any float width to any other, but never integers, booleans or
    fp8 (quantized weights, whose scales live in other tensors) into a floating parameter."""
    if not target.is_floating_point:
        return source == target
    return source.is_floating_point and source.itemsize > 1


def load_weights(model: CheckpointModel, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Fill every parameter from a complete checkpoint (start-up: nothing to roll back to)."""
    seen = set()
    for name, tensor in tensors:
        try:
            target = target_for(model, name, tuple(tensor.shape), tensor.dtype)
        except ValueError as exc:
            hint = exc.hint if isinstance(exc, DtypeMismatch) else "is the checkpoint for this config.json?"
            raise ModelLoadError(f"{exc}: {hint}") from None
        if target is not None:
            target.copy_(tensor)
            seen.add(name)
    missing = [name for name in model.checkpoint_names() if name not in seen]
    if missing:
        raise ModelLoadError(
            f"the checkpoint lacks {len(missing)} tensors of this model, e.g. {missing[:3]}: is it complete "
            "(every shard downloaded) and for this config.json?"
        )


def check_update(model: CheckpointModel, shapes: dict[str, tuple[int, ...]], *, complete: bool) -> None:
    """Refuse an update before it touches anything: unknown names, wrong shapes, and (`complete`) missing ones."""
    try:
        for name, shape in shapes.items():
            target_for(model, name, shape)
    except ValueError as exc:
        raise WeightUpdateError(f"weight update refused, nothing changed: {exc}") from None
    if complete:
        missing = [name for name in model.checkpoint_names() if name not in shapes]
        if missing:
            raise WeightUpdateError(
                f"weight update refused, nothing changed: the checkpoint lacks {len(missing)} tensors, e.g. "
                f"{missing[:3]}"
            )


def apply_update(model: CheckpointModel, tensors: Iterator[tuple[str, torch.Tensor]] | Iterable) -> int:
    """Copy the tensors in; if anything fails half-way, put back every row already overwritten, bit for bit.

    Each target's previous rows are copied to host memory just before they are overwritten, so the backup costs at
    most one host copy of the model and nothing when the update fails early. Returns the number of tensors copied.
    """
    backups: list[tuple[torch.Tensor, torch.Tensor]] = []
    try:
        for name, tensor in tensors:
            target = target_for(model, name, tuple(tensor.shape), tensor.dtype)
            if target is None:
                continue
            backups.append((target, target.to("cpu", copy=True)))
            target.copy_(tensor)
    except Exception as exc:
        for target, previous in reversed(backups):
            target.copy_(previous)
        reason = f"{type(exc).__name__}: {exc}".splitlines()[0]
        raise WeightUpdateError(
            f"weight update failed and was rolled back ({len(backups)} tensors restored): {reason}"
        ) from exc
    return len(backups)


def read_weight(model: CheckpointModel, name: str) -> torch.Tensor:
    """A copy of the current value of checkpoint tensor `name` (a shard of a fused projection where fused)."""
    try:
        target = model.checkpoint_target(name)
    except KeyError:
        raise WeightUpdateError(
            f"no weight named {name!r}: use an HF checkpoint name such as {model.checkpoint_names()[0]!r}"
        ) from None
    if target is None:
        raise WeightUpdateError(f"{name!r} is not stored by this model (it is recomputed or tied)")
    return target.clone()
