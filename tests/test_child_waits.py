"""The waits on children that tests use are bounded: a child that hangs fails its test with what it printed, it never
holds the whole run (CI once ran past its limit on such a wait)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

from omnirun.server.testing import running_server, wait_until_healthy
from omnirun.testing import read_line_within


def _child(code: str) -> subprocess.Popen:
    argv = [sys.executable, "-c", code]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_read_line_within_returns_the_line_a_child_prints():
    child = _child("import time; print('ready', flush=True); time.sleep(30)")
    try:
        assert read_line_within(child, 60) == "ready\n"
    finally:
        child.kill()
        child.wait()


def test_read_line_within_fails_and_kills_a_silent_child_with_its_stderr():
    child = _child("import sys, time; sys.stderr.write('stuck loading\\n'); sys.stderr.flush(); time.sleep(60)")
    started = time.monotonic()
    with pytest.raises(AssertionError, match="no line from the child within 1 s:\nstuck loading"):
        read_line_within(child, 1.0)
    assert time.monotonic() - started < 20
    assert child.wait(10) is not None  # killed, not left behind


def test_wait_until_healthy_gives_up_on_a_server_that_answers_but_never_200():
    app = FastAPI()
    app.get("/health")(lambda: PlainTextResponse("starting", status_code=503))
    sleeper = _child("import time; time.sleep(60)")  # stands in for the server process: alive throughout
    try:
        with running_server(app) as url:
            started = time.monotonic()
            with pytest.raises(AssertionError, match="not healthy within 1 s: /health answered 503"):
                wait_until_healthy(url, sleeper, timeout_s=1.0)
            assert time.monotonic() - started < 20
    finally:
        sleeper.kill()
        sleeper.wait()
