"""Where this process sits in the world: rank, world size, local rank and the rendezvous address.

Pure arithmetic on flags and environment variables, checked before any socket opens: a bad combination is a one-line
error naming the fix, not a rendezvous that never completes. Three ways in, as SGLang has them:
one node (a free local port), several nodes (`--nnodes/--node-rank/--dist-init-addr`), or torchrun's environment.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Mapping

from omnirun.errors import DistributedInitError

# What torchrun (torch.distributed.run) exports to every process it starts.
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclasses.dataclass(frozen=True)
class WorldSpec:
    """One rank's place in the world; picklable, so a launcher can hand a worker its own (`for_local_rank`)."""

    rank: int
    world_size: int
    local_rank: int
    nnodes: int
    host: str
    port: int
    from_torchrun: bool = False

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def init_method(self) -> str:
        return "env://" if self.from_torchrun else f"tcp://{self.address}"

    def for_local_rank(self, local_rank: int) -> WorldSpec:
        """The spec of another process on this node (same address): what a launcher passes to the worker it spawns."""
        _check_local_rank(local_rank, self.ranks_per_node)
        node_rank = self.rank // self.ranks_per_node
        return dataclasses.replace(self, rank=node_rank * self.ranks_per_node + local_rank, local_rank=local_rank)


def plan_world(
    world_size: int | None = None,
    local_rank: int = 0,
    *,
    nnodes: int = 1,
    node_rank: int = 0,
    dist_init_addr: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> WorldSpec:
    """This process's spec. torchrun's variables win when set (then `world_size`, if given, must agree with them);
    otherwise ranks are numbered node by node: rank = node_rank * (world_size / nnodes) + local_rank."""
    env = os.environ if environ is None else environ
    if any(name in env for name in TORCHRUN_VARS):
        return _from_torchrun(env, world_size, nnodes, dist_init_addr)
    world_size = 1 if world_size is None else world_size
    if world_size < 1:
        raise DistributedInitError(f"world size {world_size} is not positive: use --tp-size 1 or more")
    if nnodes < 1:
        raise DistributedInitError(f"--nnodes {nnodes} is not positive: use --nnodes 1 or more")
    if not 0 <= node_rank < nnodes:
        raise DistributedInitError(
            f"--node-rank {node_rank} is out of range for --nnodes {nnodes}: use 0..{nnodes - 1}, one per node"
        )
    if world_size % nnodes:
        raise DistributedInitError(
            f"world size {world_size} does not split evenly over --nnodes {nnodes}: "
            f"use a multiple of {nnodes} ranks, or another --nnodes"
        )
    per_node = world_size // nnodes
    _check_local_rank(local_rank, per_node)
    if dist_init_addr is not None:
        host, port = parse_dist_init_addr(dist_init_addr)
    elif nnodes > 1:
        raise DistributedInitError(
            f"--nnodes {nnodes} needs --dist-init-addr HOST:PORT: give node 0's address, the same on every node"
        )
    else:
        host, port = "127.0.0.1", free_port()
    return WorldSpec(node_rank * per_node + local_rank, world_size, local_rank, nnodes, host, port)


def parse_dist_init_addr(addr: str) -> tuple[str, int]:
    """'host:port' or '[ipv6]:port' -> (host, port)."""
    host, sep, port = addr.strip().rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 2**16:
        raise DistributedInitError(
            f"--dist-init-addr {addr!r} is not HOST:PORT: give node 0's address and a free port, e.g. 10.0.0.1:29500"
        )
    return host, int(port)


def free_port() -> int:
    """A port free now on this host (the rendezvous binds it moments later; a race lost is a clear listen error)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check_local_rank(local_rank: int, per_node: int) -> None:
    if not 0 <= local_rank < per_node:
        raise DistributedInitError(
            f"local rank {local_rank} is out of range for {per_node} rank(s) per node: use 0..{per_node - 1}"
        )


def _from_torchrun(
    env: Mapping[str, str], world_size: int | None, nnodes: int, dist_init_addr: str | None
) -> WorldSpec:
    missing = [name for name in TORCHRUN_VARS if name not in env]
    if missing:
        raise DistributedInitError(
            f"torchrun's environment is incomplete (missing {', '.join(missing)}): launch with torchrun, "
            f"or unset {', '.join(n for n in TORCHRUN_VARS if n in env)}"
        )
    if nnodes != 1 or dist_init_addr is not None:
        raise DistributedInitError(
            "torchrun's environment and --nnodes/--dist-init-addr are both set: drop the flags (torchrun places the "
            "ranks) or launch without torchrun"
        )
    try:
        rank, size, local_rank, port = (int(env[n]) for n in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"))
    except ValueError:
        values = ", ".join(f"{n}={env[n]!r}" for n in TORCHRUN_VARS)
        raise DistributedInitError(f"torchrun's variables are not integers ({values}): launch with torchrun") from None
    if world_size is not None and world_size != size:
        raise DistributedInitError(
            f"world size {world_size} differs from torchrun's WORLD_SIZE={size}: start torchrun with {world_size} "
            f"processes in all, or ask for {size}"
        )
    if size < 1 or not 0 <= rank < size or not 0 <= local_rank <= rank or not 0 < port < 2**16:
        raise DistributedInitError(
            f"torchrun's variables do not fit together (RANK={rank}, WORLD_SIZE={size}, LOCAL_RANK={local_rank}, "
            f"MASTER_PORT={port}): launch with torchrun"
        )
    # torchrun also exports LOCAL_WORLD_SIZE (ranks on this node); without it, count one node.
    per_node = env.get("LOCAL_WORLD_SIZE", "")
    nodes = size // int(per_node) if per_node.isdigit() and int(per_node) > 0 and size % int(per_node) == 0 else 1
    return WorldSpec(rank, size, local_rank, nodes, env["MASTER_ADDR"], port, from_torchrun=True)
