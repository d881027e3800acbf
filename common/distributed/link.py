"""Rank 0's end of a tensor-parallel group: every step and every collective call goes to the other ranks first, and
any failure of the group becomes one WorkerError that names the rank and what happened to it.

A group that failed is not repaired: a rank may be dead, or stuck in a collective the others left, so the link
stops the local workers and every later call raises the same error (create a new LLM).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

import torch

from omnirun.distributed.control import ControlChannel
from omnirun.distributed.local_workers import STOP_GRACE_S, LocalWorkers
from omnirun.errors import OmnirunError, WorkerError

logger = logging.getLogger(__name__)

# After a collective failed: how long to wait for the failed rank's reason (it writes it just before exiting).
FAILURE_EVIDENCE_S = 3.0


class WorkerLink:
    def __init__(self, channel: ControlChannel, local: LocalWorkers | None):
        self.channel = channel
        self.local = local
        self.broken: WorkerError | None = None
        self._stopped = False

    @property
    def world_size(self) -> int:
        return self.channel.world_size

    def send(self, kind: str, payload: Any = None) -> None:
        """Queue a command on every other rank: ("step", HostBatch) or ("call", (method, args, kwargs))."""
        if self.broken is not None:
            raise self.broken
        self.channel.send((kind, payload))

    def call(self, method: str, args: tuple, kwargs: dict) -> None:
        self.send("call", (method, to_host(args), to_host(kwargs)))

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Around rank 0's part of a collective operation: anything but an error every rank agreed on (an
        OmnirunError such as a refused weight update) leaves the group out of step, so it is shut down."""
        try:
            yield
        except OmnirunError:  # agreed on every rank, or already a WorkerError
            raise
        except Exception as exc:
            raise self.fail(exc) from exc

    def check_alive(self) -> None:
        """Raise (at start-up, while waiting for the others) if a local worker already exited."""
        dead = self.local.dead() if self.local is not None else {}
        if dead:
            raise self.fail(RuntimeError("a worker exited while the group was forming"))

    def fail(self, exc: BaseException) -> WorkerError:
        """The WorkerError for a failure of the group seen on rank 0 as `exc`; stops the local workers."""
        if self.broken is not None:
            return self.broken
        reasons, deadline = {}, time.monotonic() + FAILURE_EVIDENCE_S
        while True:
            reasons = self.channel.failures()
            dead = self.local.dead() if self.local is not None else {}
            if reasons or time.monotonic() >= deadline:
                break
            if dead:  # exited without a word (killed): give a failing one a moment to be counted, then stop
                time.sleep(0.2)
                reasons = self.channel.failures()
                break
            time.sleep(0.1)
        parts = []
        for rank in sorted(set(reasons) | set(dead)):
            how = f" ({dead[rank]})" if rank in dead else ""
            parts.append(f"rank {rank}{how}: {reasons.get(rank, 'died without a reason')}")
        if not parts:
            parts.append(f"rank 0: {' '.join(f'{type(exc).__name__}: {exc}'.split())[:1000]}")
        self.broken = WorkerError(
            f"the tensor-parallel group failed and was shut down: {'; '.join(parts)}: create a new LLM (a rank "
            "that died may need its device freed first)"
        )
        self._stop_local(grace_s=0.0)
        return self.broken

    def shutdown(self) -> None:
        """Tell every rank to leave (each closes its runner and exits), then wait for the local ones."""
        if self._stopped:
            return
        if self.broken is None:
            try:
                self.channel.send(("shutdown", None))
            except Exception as exc:  # a rank already gone: the local ones are stopped below regardless
                logger.warning("could not tell every rank to shut down: %s", " ".join(str(exc).split())[:300])
        self._stop_local(grace_s=STOP_GRACE_S)

    def _stop_local(self, grace_s: float) -> None:
        self._stopped = True
        if self.local is not None:
            self.local.wait_for_exit(grace_s)


def to_host(obj: Any) -> Any:
    """`obj` with every tensor in it copied to host memory (a device tensor pickled to another rank would name a
    device that rank does not own); lists, tuples and dicts are walked, iterators become lists."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu")
    if isinstance(obj, dict):
        return {k: to_host(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [to_host(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(to_host(v) for v in obj)
    return obj
