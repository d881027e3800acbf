"""A dead engine stops `omnirun serve`: the process exits non-zero, so that a supervisor (systemd, Kubernetes)
restarts it, as vLLM's API server does when its engine core dies. Open requests have failed by then already (the
engine client ends them with an error at once); the server would otherwise go on answering 500 forever.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from omnirun.errors import EngineClosedError

logger = logging.getLogger(__name__)

# The exit status of a server whose engine died.
ENGINE_DIED_EXIT = 1
# How often the engine is checked (a dead process or thread is seen within this).
CHECK_S = 0.25
# How long uvicorn may take to close its connections before it is made to stop at once.
GRACE_S = 3.0


class EngineWatchdog:
    """A thread that checks the engine every CHECK_S while uvicorn `server` runs; if the engine is gone it logs why
    and stops the server. `death` then holds the reason (None while the engine lives)."""

    def __init__(self, engine: Any, server: Any):
        self._engine = engine  # an engine client: check_alive() raises EngineClosedError once it is gone
        self._server = server
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="omnirun-engine-watchdog", daemon=True)
        self.death: str | None = None

    def __enter__(self) -> EngineWatchdog:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop watching (before the engine is closed on purpose, which is no death)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def _watch(self) -> None:
        while not self._stop.wait(CHECK_S):
            try:
                self._engine.check_alive()
            except EngineClosedError as exc:
                self.death = str(exc)
                break
        else:
            return
        logger.error("the engine is gone (%s): the server stops, exit status %d", self.death, ENGINE_DIED_EXIT)
        self._server.should_exit = True
        if not self._stop.wait(GRACE_S):
            self._server.force_exit = True  # a client still holding a connection open does not keep it up
