"""A process group shared with a trainer (RLHF): the trainer's rank 0 broadcasts new weights to every inference rank.

The trainer and the inference ranks live in different torch.distributed worlds, so the group cannot come from
`dist.new_group` (which needs every member of one world). As SGLang's `init_custom_process_group` does, each member
opens torch's TCPStore at the trainer's address and builds a process group of its own on it with torch's group
constructor; the group's ranks are its own (trainer 0, inference ranks from `rank_offset`), apart from the default
group's. The store keys live under `<group_name>/`, so a trainer that builds the group the same way (SGLang's helper,
or `join_weights_group` here) meets us there.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from omnirun.errors import DistributedInitError, WeightUpdateError

DEFAULT_WEIGHTS_GROUP_TIMEOUT_S = 300.0


def join_weights_group(
    *, host: str, port: int, rank: int, world_size: int, group_name: str, backend: str, timeout_s: float
) -> dist.ProcessGroup:
    """Join (rank 0: host the store for) the group `group_name` of `world_size` members; returns when all joined."""
    if not group_name:
        raise DistributedInitError("a weights update group needs a non-empty group_name")
    if not 0 <= rank < world_size:
        raise DistributedInitError(
            f"rank {rank} is out of range for a weights update group of {world_size}: rank_offset + tp rank must be "
            f"below world_size (the trainer's rank 0 counts too)"
        )
    if group_name in c10d._world.pg_names.values():
        raise DistributedInitError(f"a process group named {group_name!r} already exists here: pick another name")
    timeout = timedelta(seconds=timeout_s)
    address = f"{host}:{port}"
    try:
        store = dist.TCPStore(
            host, port, world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=False, multi_tenant=True
        )
        # global_ranks_in_group=[]: torch then treats the group as a world of its own instead of looking this rank
        # up in the default group.
        group, _ = c10d._new_process_group_helper(
            world_size, rank, [], backend, store, group_name=group_name, timeout=timeout
        )
    except (dist.DistError, RuntimeError, ValueError) as exc:
        reason = " ".join(str(exc).split())[:300]
        raise DistributedInitError(
            f"rank {rank} could not join the weights update group {group_name!r} at {address} within {timeout_s:g} s "
            f"({reason}): check that the trainer and every inference rank use the same address and world_size"
        ) from None
    # Collectives map group ranks through this table; in a world of its own, rank i is rank i.
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def leave_weights_group(group: dist.ProcessGroup) -> None:
    dist.destroy_process_group(group)


@dataclasses.dataclass(frozen=True)
class IncomingTensor:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


def parse_incoming(names: Sequence[str], dtypes: Sequence, shapes: Sequence) -> list[IncomingTensor]:
    """The update's metadata as given on every rank, checked before anything is received: equal lengths, torch
    dtypes (a torch.dtype or its name: "bfloat16", "torch.bfloat16"), shapes of non-negative ints."""
    names, dtypes, shapes = list(names), list(dtypes), list(shapes)
    if not len(names) == len(dtypes) == len(shapes):
        raise WeightUpdateError(
            f"weight update refused, nothing received: {len(names)} names, {len(dtypes)} dtypes and {len(shapes)} "
            "shapes given; pass one dtype and one shape per name"
        )
    incoming = []
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        incoming.append(IncomingTensor(str(name), _dtype(name, dtype), _shape(name, shape)))
    return incoming


def _dtype(name: str, dtype: object) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    found = getattr(torch, str(dtype).removeprefix("torch."), None) if isinstance(dtype, str) else None
    if not isinstance(found, torch.dtype):
        raise WeightUpdateError(
            f"weight update refused, nothing received: dtype {dtype!r} of {name!r} is not a torch dtype: use a name "
            "such as 'bfloat16', 'float16' or 'float32'"
        )
    return found


def _shape(name: str, shape: object) -> tuple[int, ...]:
    try:
        dims = tuple(shape)  # type: ignore[arg-type]
        if all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in dims):
            return dims
    except TypeError:
        pass
    raise WeightUpdateError(
        f"weight update refused, nothing received: shape {shape!r} of {name!r} is not a list of non-negative ints"
    )


def receive_broadcast(
    group: dist.ProcessGroup, incoming: list[IncomingTensor], device: torch.device
) -> list[tuple[str, torch.Tensor]]:
    """Each tensor in order, broadcast by the group's rank 0 (the trainer) into a new buffer on `device`."""
    received = []
    for spec in incoming:
        buffer = torch.empty(spec.shape, dtype=spec.dtype, device=device)
        dist.broadcast(buffer, group=group, group_src=0)
        received.append((spec.name, buffer))
    return received
