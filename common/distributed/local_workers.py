"""The worker processes one node's first process starts for the other ranks of that node.

Spawned (never forked: a forked child inherits device contexts and threads it cannot use). Each worker exits when
rank 0 tells it to, when its parent process dies (it checks every half second, so no orphan outlives a killed
parent), or when it fails (after leaving its reason in the rendezvous store).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

# How long a worker may take to exit after the shutdown command before it is terminated.
STOP_GRACE_S = 30.0


class LocalWorkers:
    def __init__(self, target: Callable[..., None], args_per_rank: Sequence[tuple[int, tuple[Any, ...]]]):
        """Start `target(*args)` in one spawned process per (rank, args)."""
        context = multiprocessing.get_context("spawn")
        self.processes: dict[int, multiprocessing.process.BaseProcess] = {}
        for rank, args in args_per_rank:
            process = context.Process(
                target=_run_child, args=(os.getpid(), target, args), name=f"omnirun-rank{rank}", daemon=True
            )
            process.start()
            self.processes[rank] = process

    def dead(self) -> dict[int, str]:
        """Ranks whose process has exited, with how ("exit code 1", "killed by SIGKILL")."""
        return {rank: _how_it_ended(p.exitcode) for rank, p in self.processes.items() if p.exitcode is not None}

    def wait_for_exit(self, timeout_s: float) -> None:
        """Wait until every worker exited, at most `timeout_s`; then terminate (and finally kill) the rest."""
        deadline = time.monotonic() + timeout_s
        for process in self.processes.values():
            process.join(max(0.0, deadline - time.monotonic()))
        for process in self.processes.values():
            if process.is_alive():
                process.terminate()
                process.join(5.0)
            if process.is_alive():
                process.kill()
                process.join(5.0)


def _how_it_ended(exitcode: int) -> str:
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


def _run_child(parent_pid: int, target: Callable[..., None], args: tuple[Any, ...]) -> None:
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), name="omnirun-parent-watch", daemon=True).start()
    target(*args)


def _exit_with_parent(parent_pid: int) -> None:
    while True:
        time.sleep(0.5)
        if os.getppid() != parent_pid:  # re-parented: the process that started us is gone
            os._exit(1)
