"""The engine process behind `omnirun serve`: one message per step whatever the number of streams, a child
killed mid-stream reported to every open request at once, a child whose engine thread died stopping by itself,
start-up errors as one line, no child left behind."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from omnirun.distributed.world import free_port
from omnirun.engine import LLM
from omnirun.engine.process import EngineProcess, _how_it_ended
from omnirun.engine.process_child import ENGINE_THREAD_DIED, LIVENESS_CHECK_S, _Sender, _StepOutbox
from omnirun.engine.process_child import _serve as serve_the_parent
from omnirun.sampling import SamplingParams
from omnirun.server.app import create_app
from omnirun.server.testing import running_server, wait_until_healthy

MODEL = "tiny"


@pytest.fixture(scope="module")
def engine():
    with EngineProcess(device="cpu", dtype="float32", max_total_tokens=8192) as engine:
        yield engine


def test_the_parent_reads_one_message_per_step_not_one_per_token(engine):
    prompts = [f"Stream {i} of the engine process" for i in range(16)]

    async def one(client: openai.AsyncOpenAI, prompt: str) -> int:
        stream = await client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}, stream=True
        )
        return sum([len(c.choices[0].text) > 0 async for c in stream])

    async def all_of_them(url: str) -> list[int]:
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    with running_server(create_app(engine, served_model_name=MODEL)) as url:
        before = engine.steps_received
        asyncio.run(all_of_them(url))
        messages = engine.steps_received - before
    # 16 x 12 = 192 tokens; the requests run together, so about 12 decode steps (+ prefills, + a round per
    # arrival or abort); far fewer messages than tokens.
    assert messages < 16 * 12 / 3, messages


def test_a_killed_engine_process_ends_every_open_request_at_once(engine):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 1000, "ignore_eos": True, "temperature": 0}
    streams: dict[int, tuple[list[str], float]] = {}
    plain: list[tuple[int, str, float]] = []

    def stream(url: str, i: int) -> None:
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=30) as response:
            lines = [line for line in response.iter_lines() if line]
        streams[i] = (lines, time.monotonic())

    def not_streamed(url: str) -> None:
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        plain.append((response.status_code, response.json()["error"]["message"], time.monotonic()))

    with running_server(create_app(engine, served_model_name=MODEL)) as url:
        threads = [threading.Thread(target=stream, args=(url, i)) for i in range(4)]
        threads.append(threading.Thread(target=not_streamed, args=(url,)))
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 30
        while (engine.stats().running if engine.stats() else 0) < 5:
            assert time.monotonic() < deadline, "the five requests did not start"
            time.sleep(0.005)
        killed = time.monotonic()
        os.kill(engine.pid, signal.SIGKILL)
        for thread in threads:
            thread.join(10)
        assert len(streams) == 4 and len(plain) == 1
        for lines, ended in streams.values():
            assert lines[-1] == "data: [DONE]" and "killed by SIGKILL" in lines[-2], lines[-3:]
            assert ended - killed < 2.0
        status, message, ended = plain[0]
        assert status == 500 and "killed by SIGKILL" in message and "\n" not in message and ended - killed < 2.0
        assert httpx.get(f"{url}/health").status_code == 500
        late = httpx.post(f"{url}/v1/completions", json={**body, "max_tokens": 2})
        assert late.status_code == 500 and "killed by SIGKILL" in late.json()["error"]["message"]
    start = time.monotonic()
    engine.close()
    assert time.monotonic() - start < 3.0


def _serve(*flags: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", "omnirun.cli", "serve", "--device", "cpu", "--log-level", "warning", *flags]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_bad_model_path_is_a_one_line_error_and_a_nonzero_exit(tmp_path):
    server = _serve("--model", str(tmp_path / "no-such-model"), "--port", "0")
    _, err = server.communicate(timeout=120)
    assert server.returncode == 2
    assert err.startswith("omnirun: error:") and err.count("\n") == 1 and "no-such-model" in err, err


def _engine_children(pid: int) -> list[int]:
    """The processes multiprocessing spawned from `pid` (not its resource tracker, which leaves on its own)."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:  # gone meanwhile
            continue
        if int(fields[1]) == pid and b"spawn_main" in cmdline:
            children.append(int(stat.parent.name))
    return children


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process tree from /proc")
def test_ctrl_c_stops_the_server_and_joins_its_engine_process():
    port = free_port()
    server = _serve("--port", str(port), "--max-total-tokens", "4096")
    try:
        wait_until_healthy(f"http://127.0.0.1:{port}", server)
        children = _engine_children(server.pid)
        assert len(children) == 1, "the engine should run in a child process"
        server.send_signal(signal.SIGINT)
        assert server.wait(30) == 0
        assert not [pid for pid in children if Path(f"/proc/{pid}").exists()]
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


class _Fatal(BaseException):
    """What no step guard catches: it ends the engine thread itself."""


def test_a_child_whose_engine_thread_dies_stops_at_once_and_tells_the_request():
    """The child's main thread waits for the parent's messages; it must notice a dead engine thread by itself and
    return (the child then exits with ENGINE_THREAD_DIED, which the parent reads as the engine's death and /health
    as a 500), not wait for the next request."""
    with LLM(device="cpu", dtype="float32", max_total_tokens=4096) as llm:
        inbox, to_child = multiprocessing.Pipe(duplex=False)
        from_child, outbox = multiprocessing.Pipe(duplex=False)
        sender = _Sender(outbox)
        steps = _StepOutbox(llm.engine, sender)
        llm.engine_loop.after_step = steps.flush

        def die() -> None:
            raise _Fatal("the loop's own bug")

        llm.engine.step = die
        to_child.send(("add", [(7, llm.encode("Hello"), SamplingParams(max_new_tokens=4))]))
        returned = []
        serving = threading.Thread(
            target=lambda: returned.append(serve_the_parent(inbox, llm.engine, llm.engine_loop, steps, sender))
        )
        serving.start()
        serving.join(1.0 + LIVENESS_CHECK_S)
        to_child.close()  # a main thread still waiting for the parent hears EOF (and returns True) now
        serving.join(5.0)
        assert returned == [False], "the child's main thread kept waiting for the parent"
        errors = []
        while from_child.poll(2.0) and not errors:
            message = from_child.recv()
            errors = message[2] if message[0] == "step" else []
        assert [(request_id, kind) for request_id, kind, _ in errors] == [(7, "EngineClosedError")]
        assert "_Fatal" in errors[0][2]
        sender.close()
    assert "lost its engine thread" in _how_it_ended(ENGINE_THREAD_DIED)


def test_an_engine_process_at_tp2_serves_the_tp1_tokens_and_stops_its_ranks():
    """The engine process starts the tensor-parallel ranks itself (as LLM does); the server's greedy streams equal an
    LLM's at TP=1, and closing the engine process leaves no rank behind."""
    flags = {"device": "cpu", "dtype": "float32", "max_total_tokens": 4096}
    prompts = ["Tensor parallel serving", "Two ranks, one answer"]
    greedy = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    with LLM(**flags) as llm:
        expected = [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    engine = EngineProcess(tp_size=2, **flags)
    try:
        ranks = _engine_children(engine.pid) if Path("/proc/self/stat").exists() else []
        assert len(ranks) == 1 or not Path("/proc/self/stat").exists(), "rank 1 should run in a child of the engine"
        with running_server(create_app(engine, served_model_name=MODEL)) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            for prompt, tokens in zip(prompts, expected, strict=True):
                out = client.completions.create(
                    model=MODEL,
                    prompt=prompt,
                    max_tokens=8,
                    temperature=0,
                    logprobs=0,
                    extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
                )
                assert [int(t.removeprefix("token_id:")) for t in out.choices[0].logprobs.tokens] == tokens
    finally:
        engine.close()
    assert not [pid for pid in ranks if Path(f"/proc/{pid}").exists()], "a rank outlived its engine process"


def test_more_waiting_requests_than_allowed_get_503_from_an_engine_process():
    """--max-queued-requests over the engine process: with one running slot, a second stream waits for its first
    token, and a third request beyond the limit of one waiting is refused with 503 while the first two go on."""
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with (
        EngineProcess(device="cpu", dtype="float32", max_total_tokens=4096, max_running_requests=1) as engine,
        running_server(create_app(engine, served_model_name=MODEL, max_queued_requests=1)) as url,
        httpx.Client(base_url=url, timeout=60) as http,
        http.stream("POST", "/v1/completions", json=body) as running,
    ):
        lines = running.iter_lines()
        assert next(line for line in lines if line.startswith("data: ")).startswith("data: {")  # it has a token
        with http.stream("POST", "/v1/completions", json={**body, "max_tokens": 3}) as waiting:
            assert waiting.status_code == 200
            refused = http.post("/v1/completions", json={**body, "stream": False, "max_tokens": 3})
            assert refused.status_code == 503 and refused.headers["Retry-After"] == "1", refused.text
            assert "--max-queued-requests" in refused.json()["error"]["message"]
            assert [line for line in lines if line][-1] == "data: [DONE]"  # the running one goes on to its end
            assert [line for line in waiting.iter_lines() if line][-1] == "data: [DONE]"
        assert http.post("/v1/completions", json={**body, "stream": False, "max_tokens": 2}).status_code == 200
