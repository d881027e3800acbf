"""`omnirun serve` as a process: its one start-up line, --max-request-bytes from the command line, and an engine
process killed under it making the server exit non-zero (for a supervisor to restart it), saying why; an engine
thread's death (--engine-in-thread) stopping the server the same way."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from omnirun.cli import main
from omnirun.engine import LLM
from omnirun.engine.client import ThreadEngine
from omnirun.errors import EngineClosedError
from omnirun.sampling import SamplingParams
from omnirun.server.testing import wait_until_healthy
from omnirun.server.watchdog import CHECK_S, EngineWatchdog

START_S = 120  # the server's start-up (two Python processes importing torch, on a loaded 2-core machine)
EXIT_S = 10  # a dead engine seen within 0.25 s, uvicorn stopped within 3 s more: 10 s is far past both


class _Server:
    """`omnirun serve --port 0` with its log read as it comes (a full pipe would block it)."""

    def __init__(self, *flags: str):
        argv = [sys.executable, "-m", "omnirun.cli", "serve", "--device", "cpu", "--port", "0", *flags]
        self.process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line.rstrip("\n"))

    def log(self) -> str:
        return "\n".join(self.lines)

    def summary(self) -> dict[str, str]:
        """The fields of the start-up line, once it is logged."""
        deadline = time.monotonic() + START_S
        while True:
            line = next((line for line in self.lines if "serving: " in line), None)
            if line is not None:
                return dict(re.findall(r"(\w+)=(\S+)", line.split("serving: ", 1)[1]))
            assert self.process.poll() is None, f"the server exited ({self.process.returncode}):\n{self.log()}"
            assert time.monotonic() < deadline, f"no start-up line within {START_S} s:\n{self.log()}"
            time.sleep(0.05)

    def __enter__(self) -> _Server:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(30)
        self._reader.join(5)


FLAGS = ("--max-total-tokens", "4096", "--dtype", "float32", "--max-request-bytes", "2048")


def test_a_killed_engine_process_makes_the_server_exit_non_zero_saying_why():
    with _Server(*FLAGS) as server:
        facts = server.summary()
        assert facts["device"] == "cpu" and facts["dtype"] == "float32" and facts["kv_tokens"] == "4096"
        assert facts["deterministic"] == "False" and facts["graphs"] == "eager" and facts["engine"] == "process"
        assert int(facts["max_running_requests"]) > 0 and facts["context_length"] == "1024"
        url = facts["address"]
        wait_until_healthy(url, server.process, timeout_s=START_S)

        # --max-request-bytes reached the app: 2,049 bytes are a 413, a small request is served
        headers = {"Content-Type": "application/json"}
        too_big = httpx.post(f"{url}/v1/completions", content=b"x" * 2049, headers=headers)
        assert too_big.status_code == 413 and "2048 bytes" in too_big.json()["error"]["message"]
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "Hello", "max_tokens": 2}).status_code == 200

        os.kill(int(facts["engine_pid"]), signal.SIGKILL)
        killed = time.monotonic()
        try:
            code = server.process.wait(EXIT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the server still runs {EXIT_S} s after its engine was killed:\n{server.log()}")
        seconds = time.monotonic() - killed
        server._reader.join(5)
        assert code == 1, server.log()
        assert any("killed by SIGKILL" in line and "the server stops" in line for line in server.lines), server.log()
    print(f"the server exited {seconds:.1f} s after its engine was killed")


class _Fatal(BaseException):
    """What no step guard catches: it ends the engine thread itself."""


def test_a_dead_engine_thread_stops_the_server_too():
    """--engine-in-thread: the watchdog reads the engine thread's death as it reads an engine process's."""

    class Server:  # what the watchdog sets on uvicorn's Server
        should_exit = force_exit = False

    def die() -> None:
        raise _Fatal("the loop's own bug")

    server = Server()
    with LLM(device="cpu", dtype="float32", max_total_tokens=4096) as llm:
        engine = ThreadEngine(llm)
        with EngineWatchdog(engine, server) as watchdog:
            time.sleep(2 * CHECK_S)
            assert not server.should_exit and watchdog.death is None  # alive: nothing happens
            llm.engine.step = die
            with pytest.raises(EngineClosedError):
                llm.generate("Hello", SamplingParams(max_new_tokens=2), use_tqdm=False)
            deadline = time.monotonic() + 5
            while not server.should_exit:
                assert time.monotonic() < deadline, "the watchdog did not stop the server"
                time.sleep(0.01)
        assert "engine thread stopped" in watchdog.death


def test_a_bad_max_request_bytes_is_a_one_line_error(capsys):
    # (--device nosuch: were the flag not checked, the next check ends the command instead of a server starting)
    assert main(["serve", "--max-request-bytes", "0", "--device", "nosuch"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("omnirun: error:") and "--max-request-bytes" in err and err.count("\n") == 1
