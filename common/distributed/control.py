"""Rank 0's commands to the other ranks of a tensor-parallel group, and the failures they report back.

Commands go on the host: `broadcast_object_list` over the control group (gloo) that `init_distributed` built, one
picklable message at a time, in the order every rank then executes them. A rank that fails writes its reason into
the rendezvous store before it exits, so rank 0 can name the rank and its exception instead of a bare "connection
closed by peer".
"""

from __future__ import annotations

import traceback
from typing import Any

import torch.distributed as dist

_FAILED_KEY = "omnirun/failed/{}"


class ControlChannel:
    def __init__(self, group: dist.ProcessGroup, store: dist.Store | None):
        self.group = group
        self.store = store
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def send(self, message: Any) -> None:
        """Rank 0: hand `message` to every other rank (returns once they all have it queued)."""
        dist.broadcast_object_list([message], group=self.group, group_src=0)

    def receive(self) -> Any:
        """Any other rank: the next message of rank 0 (waits as long as it takes)."""
        box = [None]
        dist.broadcast_object_list(box, group=self.group, group_src=0)
        return box[0]

    def report_failure(self, exc: BaseException) -> None:
        """This rank is about to exit because of `exc`: leave one line for rank 0 (best effort)."""
        if self.store is None:
            return
        last = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
        where = f" (at {last[0].filename}:{last[0].lineno})" if last else ""
        reason = " ".join(f"{type(exc).__name__}: {exc}".split())[:2000] + where
        try:
            self.store.set(_FAILED_KEY.format(self.rank), reason)
        except Exception:  # the store (rank 0) may be gone too; exiting is all that is left
            pass

    def failures(self) -> dict[int, str]:
        """Rank 0: the reasons the other ranks left, by rank."""
        found: dict[int, str] = {}
        if self.store is None:
            return found
        for rank in range(1, self.world_size):
            key = _FAILED_KEY.format(rank)
            try:
                if self.store.check([key]):
                    found[rank] = self.store.get(key).decode(errors="replace")
            except Exception:
                break
        return found
