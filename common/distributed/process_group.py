"""Joining the default torch.distributed process group with the platform's collective backend."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING

import torch.distributed as dist

from omnirun.distributed.rendezvous import join
from omnirun.distributed.world import WorldSpec, parse_dist_init_addr, plan_world
from omnirun.errors import DistributedInitError

if TYPE_CHECKING:  # the platform is handed in: annotated, never imported here
    from omnirun.platform import Platform

# How long start-up waits for every rank to join when no --dist-timeout is given: long enough for a slow node to
# import torch, short enough that a typo in an address is an error before lunch.
DEFAULT_JOIN_TIMEOUT_S = 300.0


def init_distributed(
    platform: Platform,
    spec: WorldSpec,
    *,
    timeout_s: float | None = None,
    device_index: int | None = None,
    peers_alive: Callable[[], None] | None = None,
) -> dist.ProcessGroup:
    """Bind this rank to its device, meet every other rank, then join the default group on the platform's backend.

    `device_index` defaults to the local rank (one device per rank); platforms whose ranks share one device (the CPU)
    pass the index themselves. `timeout_s` bounds the rendezvous (default DEFAULT_JOIN_TIMEOUT_S) and, when given,
    every later collective too (as SGLang's --dist-timeout); when not, collectives keep torch's default.
    `peers_alive` is called while waiting for the others: it raises to stop waiting for a peer known to be dead
    (a local worker process that exited).
    """
    if dist.is_initialized():
        raise DistributedInitError(
            "torch.distributed is already initialised in this process: call omnirun's start-up once, or "
            "destroy_process_group() first"
        )
    index = spec.local_rank if device_index is None else device_index
    count = platform.device_count()
    if not 0 <= index < max(count, 1):
        raise DistributedInitError(
            f"rank {spec.rank} needs {platform.name} device {index} but this node has {count}: run at most {count} "
            "rank(s) per node, or make the device visible"
        )
    # Set first: backends that pick "the current device" (nccl, hccl) then use this rank's.
    platform.set_device(index)
    store = join(spec, DEFAULT_JOIN_TIMEOUT_S if timeout_s is None else timeout_s, peers_alive=peers_alive)
    kwargs = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
    dist.init_process_group(
        backend=platform.distributed_backend, store=store, rank=spec.rank, world_size=spec.world_size, **kwargs
    )
    _joined.store = store
    # Rank 0's commands to the other ranks travel on the host, in a gloo group of their own whose timeout is
    # practically none: a worker waits for the next step however long the engine idles (a dead peer is still
    # noticed at once: gloo fails on the closed connection).
    _joined.control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT) if spec.world_size > 1 else None
    return dist.group.WORLD


# How long a worker waits for rank 0's next command: a server may idle for days.
CONTROL_TIMEOUT = timedelta(days=365)


class _Joined:
    store: dist.Store | None = None
    control: dist.ProcessGroup | None = None


_joined = _Joined()


def rendezvous_store() -> dist.Store | None:
    """The TCPStore every rank met on (ranks leave their failure reasons there); None before init_distributed."""
    return _joined.store if dist.is_initialized() else None


def control_group() -> dist.ProcessGroup | None:
    """The host-side gloo group for rank 0's commands; None for a world of one or before init_distributed."""
    return _joined.control if dist.is_initialized() else None


def init_process_group(
    platform: Platform,
    *,
    rank: int = 0,
    world_size: int = 1,
    local_rank: int = 0,
    init_method: str = "env://",
) -> None:
    """The runner's world-of-one entry (tcp://host:port or env://), through `init_distributed`."""
    if init_method == "env://":
        spec = plan_world(world_size)
    elif init_method.startswith("tcp://"):
        host, port = parse_dist_init_addr(init_method.removeprefix("tcp://"))
        spec = WorldSpec(rank, world_size, local_rank, 1, host, port)
    else:
        raise DistributedInitError(f"init method {init_method!r} is not tcp://HOST:PORT or env://: use one of those")
    init_distributed(platform, spec, device_index=local_rank)
