"""Process groups and collectives, on the backend the platform names.

Start-up: `plan_world(...)` says where this process sits (one node, `--nnodes/--node-rank/--dist-init-addr`, or
torchrun's environment); `init_distributed(platform, spec, timeout_s=...)` meets the other ranks and joins the group.
Collectives: `platform.make_communicator(group)` -> a `Communicator` (all_reduce, all_gather, broadcast,
broadcast_object, barrier).
"""

from omnirun.distributed.communicator import Communicator
from omnirun.distributed.process_group import DEFAULT_JOIN_TIMEOUT_S, init_distributed, init_process_group
from omnirun.distributed.world import WorldSpec, plan_world

__all__ = [
    "DEFAULT_JOIN_TIMEOUT_S",
    "Communicator",
    "WorldSpec",
    "init_distributed",
    "init_process_group",
    "plan_world",
]
