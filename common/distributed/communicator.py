"""Collectives over one process group, through torch.distributed: what `Platform.make_communicator` returns by default.

The runner calls only these six methods; a platform may hand back a faster subclass (a custom all-reduce) and the
runner never knows which it got.

Inside a captured graph (CUDA/HIP graphs with NCCL/RCCL; torch records the collective kernels on the capture stream):
- `all_reduce` and `broadcast` work in place on the caller's tensor: no allocation, no host sync, so replay reads and
  writes the same addresses as capture.
- `all_gather` allocates its output during capture from the graph's private pool, which replay reuses at the same
  address; pass `out=` to gather into a buffer the caller owns.
- `broadcast_object`, `all_gather_object` and `barrier` synchronise with the host: never call them while capturing.
Not checked here: this machine has no GPU, so graph capture of these calls is untested (gloo cannot be captured).

A group of one does no collective call at all: a single-device runner pays nothing for holding a communicator.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

# torch 2.13 renamed all_gather_into_tensor (and warns on every call of the old name); older builds have only that.
_all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Communicator:
    """all_reduce (sum), all_gather and broadcast (tensors and small objects), all_gather_object, barrier over `group`.

    `group` None means the default (world) group; when torch.distributed is not initialised at all, the
    communicator is a world of one. Ranks given to `src` are ranks within the group."""

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group
        # Read once here, not per call: these are host-side lookups a captured step must not repeat.
        joined = group is not None or (dist.is_available() and dist.is_initialized())
        self.world_size = dist.get_world_size(group) if joined else 1
        self.rank = dist.get_rank(group) if joined else 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over the group, in place; returns `tensor`."""
        if self.world_size > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = 0, out: torch.Tensor | None = None) -> torch.Tensor:
        """Every rank's `tensor` concatenated along `dim`, in rank order (a new tensor, or `out` when given)."""
        if self.world_size == 1:
            if out is None:
                return tensor
            return out.copy_(tensor)
        tensor = tensor.reshape(1) if tensor.dim() == 0 else tensor  # scalars gather into a vector
        dim = dim % tensor.dim()
        gathered_shape = (*tensor.shape[:dim], tensor.shape[dim] * self.world_size, *tensor.shape[dim + 1 :])
        if out is not None and tuple(out.shape) != gathered_shape:
            raise ValueError(f"all_gather out= has shape {tuple(out.shape)}, expected {gathered_shape}")
        if dim == 0:
            target = out if out is not None and out.is_contiguous() else tensor.new_empty(gathered_shape)
            _all_gather_into(target, tensor.contiguous(), group=self.group)
        else:
            # Gather rank-major along dim 0 (the layout every backend accepts), then move the rank axis next to `dim`:
            # one copy, no Python loop over ranks.
            flat = tensor.new_empty((self.world_size * tensor.shape[0], *tensor.shape[1:]))
            _all_gather_into(flat, tensor.contiguous(), group=self.group)
            target = flat.view(self.world_size, *tensor.shape).movedim(0, dim).reshape(gathered_shape)
        if out is not None and target is not out:
            return out.copy_(target)
        return target

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """`src`'s tensor on every rank, in place; returns `tensor`."""
        if self.world_size > 1:
            dist.broadcast(tensor, group=self.group, group_src=src)
        return tensor

    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        """`src`'s picklable object on every rank (others pass anything). Syncs the host: not for captured graphs."""
        if self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, group=self.group, group_src=src)
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's picklable object, in rank order. Syncs the host: not for captured graphs."""
        if self.world_size == 1:
            return [obj]
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, obj, group=self.group)
        return gathered

    def barrier(self) -> None:
        """Wait until every rank of the group arrives. Syncs the host: not for captured graphs."""
        if self.world_size > 1:
            dist.barrier(group=self.group)
