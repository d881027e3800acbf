"""`omnirun generate` and `omnirun bench` from the command line."""

from __future__ import annotations

import json
import subprocess
import sys

from omnirun.cli import main
from omnirun.engine import LLM
from omnirun.sampling import SamplingParams


def test_generate_prints_the_greedy_text_of_the_embedded_model(capsys):
    assert main(["generate", "--device", "cpu", "--prompt", "Hello", "--max-new-tokens", "12"]) == 0
    printed = capsys.readouterr().out
    expected = LLM(device="cpu").generate("Hello", SamplingParams(temperature=0, max_new_tokens=12))[0].text
    assert printed == expected + "\n"

    assert main(["generate", "--device", "cpu", "--prompt", "Hello", "--max-new-tokens", "12", "--stream"]) == 0
    assert capsys.readouterr().out == expected + "\n"


def test_generate_several_prompts_and_sampling_flags(capsys):
    argv = ["generate", "--device", "cpu", "--prompt", "a", "--prompt", "b", "--max-new-tokens", "4"]
    assert main([*argv, "--temperature", "0.8", "--top-p", "0.9", "--sampling-seed", "3"]) == 0
    out = capsys.readouterr().out
    assert out.count("--- [") == 2 and "length, 4 tokens" in out


def test_generate_errors_are_one_line(capsys):
    argv = ["generate", "--device", "cpu", "--model", "tiny-llama", "--load-format", "dummy", "--prompt", "x"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("omnirun: error:") and "--tokenizer" in err and err.count("\n") == 1
    assert main(["generate", "--device", "cpu", "--max-total-tokens", "10"]) == 2
    assert "--max-total-tokens" in capsys.readouterr().err


def test_bench_reports_and_writes_json(tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = ["bench", "--device", "cpu", "--model", "tiny-llama", "--load-format", "dummy", "--batch-size", "3"]
    argv += ["--num-prompts", "5", "--input-len", "8", "--output-len", "6", "--json", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    for label in ("output throughput", "TTFT", "TPOT", "decode step", "roofline fraction"):
        assert label in printed
    result = json.loads(out.read_text())
    assert result["num_prompts"] == 5 and result["batch_size"] == 3
    for key in ("output_tokens_per_s", "ttft_ms_mean", "tpot_ms_mean", "decode_step_ms_median", "copy_GBps"):
        assert result[key] > 0
    assert 0 < result["roofline_fraction_copy_bw"]


def test_console_entry_point_runs():
    result = subprocess.run(
        [sys.executable, "-m", "omnirun.cli", "generate", "--device", "cpu", "--max-new-tokens", "3"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
