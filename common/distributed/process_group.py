"""Joining the default torch.distributed process group with the platform's collective backend."""

from __future__ import annotations

import torch.distributed as dist

from omnirun.platform import Platform


def init_process_group(
    platform: Platform,
    *,
    rank: int = 0,
    world_size: int = 1,
    local_rank: int = 0,
    init_method: str = "env://",
) -> None:
    """Bind this rank to its device, then join the group on the platform's backend (nccl, hccl, xccl, gloo).

    The device is set first so that backends which pick "the current device" (nccl, hccl) use the right one.
    """
    platform.set_device(local_rank)
    dist.init_process_group(
        backend=platform.distributed_backend,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
    )
