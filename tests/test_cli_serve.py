"""`omnirun serve` from the command line, and `omnirun bench serve` against a test server."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import httpx
import pytest

from omnirun.cli import main
from omnirun.distributed.world import free_port
from omnirun.engine import LLM
from omnirun.server.app import create_app
from omnirun.server.testing import running_server, wait_until_healthy


def test_bench_serve_loads_a_server_and_writes_json(tmp_path, capsys):
    # A dummy preset without a tokenizer, as in the GPU benchmark: token-id prompts only.
    out = tmp_path / "serve.json"
    llm = LLM("tiny-llama", load_format="dummy", device="cpu", max_total_tokens=4096)
    with llm, running_server(create_app(llm, api_key="k")) as url:
        headers = {"Authorization": "Bearer k"}
        text = httpx.post(f"{url}/v1/completions", json={"prompt": "Hello"}, headers=headers)
        assert text.status_code == 400 and "tokenizer" in text.json()["error"]["message"]
        chat = httpx.post(
            f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]}, headers=headers
        )
        assert chat.status_code == 400 and "chat template" in chat.json()["error"]["message"]
        ids = httpx.post(
            f"{url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 2, "logprobs": 1}, headers=headers
        )
        assert ids.json()["choices"][0]["text"] == "" and ids.json()["choices"][0]["logprobs"]["tokens"][0].startswith(
            "token_id:"
        )
        argv = ["bench", "serve", "--base-url", url, "--api-key", "k", "--num-prompts", "12", "--input-len", "8"]
        argv += ["--output-len", "5", "--request-rate", "200", "--max-concurrency", "4", "--random-range-ratio", "0.5"]
        assert main([*argv, "--json", str(out), "--no-progress"]) == 0
        usage = llm.kv_usage()
        assert usage.pages_free + usage.pages_cached == usage.pages_total
    printed = capsys.readouterr().out
    for label in ("request throughput", "output throughput", "TTFT", "TPOT", "ITL"):
        assert label in printed
    result = json.loads(out.read_text())
    assert (result["completed"], result["failed"], result["max_concurrency"]) == (12, 0, 4)
    assert 12 * 2 <= result["total_output_tokens"] <= 12 * 7  # lengths in [5 * 0.5, 5 * 1.5]
    for name in ("ttft", "tpot", "itl"):
        stats = [result[f"{name}_ms_{s}"] for s in ("mean", "p50", "p90", "p99")]
        assert all(v > 0 for v in stats) and stats[1] <= stats[2] <= stats[3]
    assert result["output_tokens_per_s"] > 0 and result["request_throughput"] > 0
    each = result["requests"]  # one record per request, in the order sent
    assert len(each) == 12 and sum(r["output_tokens"] for r in each) == result["total_output_tokens"]
    assert [r["sent_s"] for r in each] == sorted(r["sent_s"] for r in each) and each[0]["sent_s"] < 0.1
    assert all(0 < r["ttft_ms"] <= r["latency_ms"] and r["error"] is None for r in each)
    assert sorted(r["ttft_ms"] for r in each)[5] == pytest.approx(result["ttft_ms_p50"], rel=0.5)


def test_bench_serve_structured_json_constrains_every_request(tmp_path):
    """--structured json: each output is a record of the bench's schema, so it ends with its JSON, long before the
    token budget that an unconstrained request (ignore_eos) always spends."""
    pytest.importorskip("xgrammar", reason="structured output needs xgrammar (pip install 'omnirun[structured]')")
    out = tmp_path / "serve.json"
    with LLM(device="cpu", dtype="float32", max_total_tokens=16384) as llm, running_server(create_app(llm)) as url:
        argv = ["bench", "serve", "--base-url", url, "--num-prompts", "6", "--input-len", "8", "--output-len", "400"]
        assert main([*argv, "--structured", "json", "--json", str(out), "--no-progress"]) == 0
    result = json.loads(out.read_text())
    assert (result["completed"], result["structured"]) == (6, "json")
    assert all(20 < r["output_tokens"] < 400 for r in result["requests"])


def test_bench_serve_counts_refused_requests_as_failed(tmp_path):
    out = tmp_path / "serve.json"
    llm = LLM("tiny-llama", load_format="dummy", device="cpu", max_total_tokens=4096)
    with llm, running_server(create_app(llm, api_key="k")) as url:
        argv = ["bench", "serve", "--base-url", url, "--api-key", "wrong", "--model", "tiny-llama"]
        argv += ["--num-prompts", "3", "--input-len", "4", "--output-len", "2", "--json", str(out), "--no-progress"]
        assert main(argv) == 1  # nothing completed
    result = json.loads(out.read_text())
    assert (result["completed"], result["failed"]) == (0, 3)
    assert result["first_error"].startswith("HTTP 401") and "API key" in result["first_error"]
    assert [r["ttft_ms"] for r in result["requests"]] == [None] * 3 and result["requests"][0]["error"].startswith(
        "HTTP 401"
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        (["serve", "--port", "70000"], "--port 70000"),
        (["serve", "--max-queued-requests", "-1"], "--max-queued-requests"),
        (["serve", "--device", "nosuch"], "nosuch"),
        (["bench", "serve", "--request-rate", "0"], "--request-rate"),
        (["bench", "serve", "--base-url", "http://127.0.0.1:9"], "cannot reach the server"),
    ],
)
def test_bad_flags_are_one_line_errors(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("omnirun: error:") and message in err and err.count("\n") == 1


def test_omnirun_serve_starts_on_the_embedded_model_and_answers():
    port = free_port()  # (a small race with other processes for this port; the test fails loudly if it loses it)
    argv = [sys.executable, "-m", "omnirun.cli", "serve", "--device", "cpu", "--port", str(port)]
    argv += ["--max-total-tokens", "4096", "--served-model-name", "tiny", "--log-level", "warning"]
    server = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until_healthy(url, server)
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 3}
        out = httpx.post(f"{url}/v1/completions", json=body).json()
        assert out["model"] == "tiny" and out["usage"]["completion_tokens"] == 3
    finally:
        server.terminate()
        # uvicorn shuts down on SIGTERM, then raises the signal again so the exit status says what stopped it
        assert server.wait(60) in (0, -signal.SIGTERM)
