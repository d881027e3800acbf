"""Moving weights into a live model: the initial load, updates that roll back on failure, and reads by name.

Names are HF checkpoint names; the model maps each to a `ShardTarget` (`checkpoint_target`): the parameter rows it
fills on this rank and which part of the full tensor they hold. A source is a full tensor, or a lazy one (a
safetensors slice: `shape`, `dtype`, `read(index)`) of which only this rank's part is ever read.

Under tensor parallelism every rank runs the same call with the same full tensors; the ranks agree on the outcome
(one host-side exchange per phase), so a refusal or a failure on any rank is raised on every rank, and a failure
rolls back every rank.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from typing import Any, Protocol

import torch

from omnirun.distributed.communicator import Communicator
from omnirun.errors import ModelLoadError, WeightUpdateError
from omnirun.layers.sharding import ShardTarget

logger = logging.getLogger(__name__)


class CheckpointModel(Protocol):
    def checkpoint_target(self, name: str) -> ShardTarget | None: ...
    def checkpoint_names(self) -> list[str]: ...


def target_for(
    model: CheckpointModel, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None
) -> ShardTarget | None:
    """Where `name` lands, checked against the incoming FULL shape (and dtype, when given); ValueError with a one-line
    reason otherwise."""
    try:
        target = model.checkpoint_target(name)
    except KeyError:
        raise ValueError(f"tensor {name!r} is not a parameter of this model") from None
    except ValueError as exc:  # the model refuses it: a full-precision weight for a layer that keeps quantized ones
        if not hasattr(exc, "hint"):
            raise
        stored = ":" if dtype is None else f" is stored as {str(dtype).removeprefix('torch.')}, but"
        raise DtypeMismatch(f"tensor {name!r}{stored} {exc}", hint=exc.hint) from None
    if target is None:
        return None
    if target.full_shape == () and tuple(shape) == (1,):  # a per-tensor scale saved as [1] (vLLM reads both)
        target = ShardTarget(target.view.view(1), (1,))
    if tuple(target.full_shape) != tuple(shape):
        raise ValueError(f"tensor {name!r} has shape {list(shape)}, the model expects {list(target.full_shape)}")
    if dtype is not None and not _castable(dtype, target.view.dtype):
        if target.view.dtype.itemsize == 1 and dtype.itemsize > 1:
            raise DtypeMismatch(
                f"tensor {name!r} is stored as {str(dtype).removeprefix('torch.')}, but its layer keeps the fp8 "
                "weights the checkpoint's quantization_config says it has",
                hint="name its module in the config's modules_to_not_convert (fp8) or ignore (compressed-tensors)",
            )
        raise DtypeMismatch(
            f"tensor {name!r} is stored as {str(dtype).removeprefix('torch.')}, which does not convert to the "
            f"model's {str(target.view.dtype).removeprefix('torch.')}"
        )
    return target


class DtypeMismatch(ValueError):
    """A checkpoint tensor whose values a cast would not keep (quantized or integer data for float weights, or full
    precision for a layer that keeps fp8)."""

    def __init__(
        self,
        message: str,
        hint: str = "omnirun loads float32/float16/bfloat16 weights; dequantize the checkpoint first (or re-save it)",
    ):
        super().__init__(message)
        self.hint = hint


def _castable(source: torch.dtype, target: torch.dtype) -> bool:
    """Whether copy_ from `source` keeps the values: any float width to any other, but never integers, booleans or
    fp8 (quantized weights, whose scales live in other tensors) into a wider floating parameter, nor anything but
    fp8 into an fp8 one."""
    if not target.is_floating_point or target.itemsize == 1:
        return source == target
    return source.is_floating_point and source.itemsize > 1


def read_part(source: Any, target: ShardTarget) -> torch.Tensor:
    """This rank's part of `source`: a view of a full tensor, or only that part read from a lazy one."""
    if isinstance(source, torch.Tensor):
        return target.take(source)
    return source.read(target.index)


def load_weights(model: CheckpointModel, tensors: Iterable[tuple[str, Any]]) -> None:
    """Fill every parameter from a complete checkpoint (start-up: nothing to roll back to)."""
    seen = set()
    for name, source in tensors:
        try:
            target = target_for(model, name, tuple(source.shape), source.dtype)
        except ValueError as exc:
            hint = exc.hint if isinstance(exc, DtypeMismatch) else "is the checkpoint for this config.json?"
            raise ModelLoadError(f"{exc}: {hint}") from None
        if target is not None:
            target.view.copy_(read_part(source, target))
            seen.add(name)
    missing = [name for name in model.checkpoint_names() if name not in seen]
    if missing:
        raise ModelLoadError(
            f"the checkpoint lacks {len(missing)} tensors of this model, e.g. {missing[:3]}: is it complete "
            "(every shard downloaded) and for this config.json?"
        )


def update_problem(
    model: CheckpointModel,
    shapes: dict[str, tuple[int, ...]],
    *,
    complete: bool,
    dtypes: dict[str, torch.dtype] | None = None,
) -> str | None:
    """Why an update cannot go in (unknown names, wrong full shapes or dtypes, and (`complete`) missing ones), or
    None: this rank's verdict, before anything is touched."""
    try:
        for name, shape in shapes.items():
            target_for(model, name, shape, (dtypes or {}).get(name))
    except ValueError as exc:
        return str(exc)
    if complete:
        missing = [name for name in model.checkpoint_names() if name not in shapes]
        if missing:
            return f"the checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}"
    return None


def agree(comm: Communicator | None, problem: str | None) -> dict[int, str]:
    """Every rank's problem (rank -> reason) for the ranks that have one; the same answer on every rank.

    Syncs the host: never inside a captured graph."""
    problems = [problem] if comm is None else comm.all_gather_object(problem)
    return {rank: reason for rank, reason in enumerate(problems) if reason is not None}


def _describe(problems: dict[int, str], size: int) -> str:
    """One reason when every rank agrees on it (or there is one rank), else each failing rank's."""
    reasons = set(problems.values())
    if size == 1 or (len(problems) == size and len(reasons) == 1):
        return next(iter(reasons))
    return "; ".join(f"rank {rank}: {reason}" for rank, reason in sorted(problems.items()))


def refuse_unless_agreed(comm: Communicator | None, problem: str | None) -> None:
    """Raise WeightUpdateError on every rank when any rank found a problem (nothing has changed yet)."""
    problems = agree(comm, problem)
    if problems:
        size = 1 if comm is None else comm.world_size
        raise WeightUpdateError(f"weight update refused, nothing changed: {_describe(problems, size)}")


def check_update(
    model: CheckpointModel,
    shapes: dict[str, tuple[int, ...]],
    *,
    complete: bool,
    comm: Communicator | None = None,
) -> None:
    """Refuse an update before it touches anything: unknown names, wrong shapes, and (`complete`) missing ones."""
    refuse_unless_agreed(comm, update_problem(model, shapes, complete=complete))


def apply_update(model: CheckpointModel, tensors: Iterable[tuple[str, Any]], comm: Communicator | None = None) -> int:
    """Copy this rank's part of each tensor in; if anything fails half-way on any rank, every rank puts back every
    row it already overwrote, bit for bit.

    Each target's previous rows are copied to host memory just before they are overwritten, so the backup costs at
    most one host copy of this rank's weights and nothing when the update fails early. Returns the number of
    tensors copied.
    """
    backups: list[tuple[torch.Tensor, torch.Tensor]] = []
    error: BaseException | None = None
    try:
        for name, source in tensors:
            target = target_for(model, name, tuple(source.shape), source.dtype)
            if target is None:
                continue
            part = read_part(source, target)
            backups.append((target.view, target.view.to("cpu", copy=True)))
            target.view.copy_(part)
    except Exception as exc:
        error = exc
    problems = agree(comm, None if error is None else f"{type(error).__name__}: {error}".splitlines()[0])
    if not problems:
        return len(backups)
    for view, previous in reversed(backups):
        view.copy_(previous)
    size = 1 if comm is None else comm.world_size
    if size == 1:
        message = f"weight update failed and was rolled back ({len(backups)} tensors restored): {problems[0]}"
    else:
        failed = ", ".join(str(rank) for rank in sorted(problems))
        message = (
            f"weight update failed on rank(s) {failed} and was rolled back on every rank ({len(backups)} tensors "
            f"restored here): {_describe(problems, size)}"
        )
    raise WeightUpdateError(message) from error


def read_weight(
    model: CheckpointModel, name: str, comm: Communicator | None = None, device: torch.device | None = None
) -> torch.Tensor:
    """A copy of the current value of checkpoint tensor `name` (a shard of a fused projection where fused), whole:
    under tensor parallelism every rank's part is gathered on `device` (every rank must call this for the same
    name; a tensor kept in host memory beside its platform form goes there for the collective)."""
    try:
        target = model.checkpoint_target(name)
    except KeyError:
        raise WeightUpdateError(
            f"no weight named {name!r}: use an HF checkpoint name such as {model.checkpoint_names()[0]!r}"
        ) from None
    except ValueError as exc:  # a layer that keeps quantized weights has no full-precision `weight` to read
        if not hasattr(exc, "hint"):
            raise
        module = name.rpartition(".")[0]
        stored = [other for other in model.checkpoint_names() if other.rpartition(".")[0] == module]
        raise WeightUpdateError(f"{name!r} is not stored: {exc}; read {', '.join(map(repr, stored))}") from None
    if target is None:
        raise WeightUpdateError(f"{name!r} is not stored by this model (it is recomputed or tied)")
    if target.dim is None or comm is None or comm.world_size == 1:
        return target.view.clone()
    if device is not None:
        target = dataclasses.replace(target, view=target.view.to(device))
    return _gather_full(target, comm)


def _gather_full(target: ShardTarget, comm: Communicator) -> torch.Tensor:
    """The full tensor from every rank's part. Parts may differ in length (vocabulary padding) and overlap
    (replicated kv heads): each rank pads its part to the longest, all ranks gather, and each part is put in its
    place (overlapping parts hold the same values)."""
    view, dim = target.view, target.dim
    place = torch.tensor([target.start, target.length], dtype=torch.int64, device=view.device)
    places = comm.all_gather(place).view(-1, 2).tolist()
    longest = max(length for _, length in places)
    padded_shape = list(view.shape)
    padded_shape[dim] = longest
    padded = view.new_zeros(padded_shape)
    padded.narrow(dim, 0, target.length).copy_(view)
    gathered = comm.all_gather(padded, dim=dim)
    full = view.new_empty(target.full_shape)
    for rank, (start, length) in enumerate(places):
        full.narrow(dim, start, length).copy_(gathered.narrow(dim, rank * longest, length))
    return full
