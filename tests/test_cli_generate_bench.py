"""`omnirun generate` and `omnirun bench` from the command line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

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


def test_bench_says_what_it_does_before_it_measures_the_bandwidth(monkeypatch, capsys):
    from omnirun import bench
    from omnirun.bandwidth import Bandwidth

    said_before = []

    def measure(platform, device):
        said_before.append(capsys.readouterr().err)
        return Bandwidth(2e9, 1e9)

    monkeypatch.setattr(bench, "measure_bandwidth", measure)
    with LLM("tiny-llama", load_format="dummy", device="cpu", dtype="float32", max_total_tokens=2048) as llm:
        bench.run_bench(llm, batch_size=2, input_len=4, output_len=3, num_prompts=2)
    assert said_before and said_before[0].rstrip().endswith(
        "omnirun bench: measuring the memory bandwidth (large copies and sums: seconds) ..."
    )
    assert "omnirun bench: warming up (2 prompts) ..." in said_before[0]


def _result(**overrides):
    r = dict(
        model="m", device="cpu", device_name="AMD", dtype="float32", attention="torch_native", graph_runner="eager"
    )
    r |= dict(batch_size=3, num_prompts=5, shared_prefix_len=16, input_len=8, output_len=6, output_tokens_per_s=12345.6)
    r |= dict(total_s=1.2, ttft_ms_mean=3.4, tpot_ms_mean=1.2, decode_step_ms_median=1.1, decode_step_bytes=1e6)
    r |= dict(copy_GBps=30.1, read_GBps=20.2, roofline_fraction_copy_bw=0.05, roofline_fraction_read_bw=0.07)
    r |= dict(prefix_caching=True, prefill_tokens_cached=64, prefill_tokens_computed=40, prefix_cache_hit_rate=0.615)
    return r | overrides


def test_bench_table_rows_are_aligned():
    from omnirun.bench import format_result

    for result in (_result(), _result(prefix_caching=False, prefill_tokens_cached=0, prefix_cache_hit_rate=0.0)):
        rows = [line for line in format_result(result).splitlines() if line.startswith("  ")]
        assert len(rows) == 8 and rows[-1].startswith("  prefix cache ")
        for row in rows:
            label, value = row[2:21].rstrip(), row[21:31]
            # a label of single-spaced words, then the value right-aligned in its column, then two spaces
            assert "  " not in label and label == label.strip() and row[20] == " ", row
            assert value.strip() and " " not in value.strip() and value[-1] != " ", row
            assert row[31:33] == "  " and row[33] != " ", row
    assert "  prefix cache            61.5%  hit rate: 64 prompt tokens cached, 40 computed" in format_result(_result())


@pytest.mark.parametrize("command", [["generate", "--prompt", "Hi"], ["bench", "--batch-size", "2"]])
def test_the_device_is_resolved_once_and_the_runner_gets_that_platform(command, monkeypatch, capsys):
    """--device is resolved at the edge (the CLI) and the Platform object is passed down to LLM, the launcher and
    the runner: nothing on the way asks the registry again."""
    from omnirun.registry import PlatformRegistry
    from omnirun.runner import ModelRunner

    selected, built_on = [], []
    select, init = PlatformRegistry.select, ModelRunner.__init__

    def counting_select(self, device=None):
        selected.append(select(self, device))
        return selected[-1]

    def recording_init(self, config, platform=None, **kwargs):
        built_on.append(platform)
        init(self, config, platform, **kwargs)

    monkeypatch.setattr(PlatformRegistry, "select", counting_select)
    monkeypatch.setattr(ModelRunner, "__init__", recording_init)
    flags = ["--device", "cpu", "--max-new-tokens", "2"] if command[0] == "generate" else ["--device", "cpu"]
    if command[0] == "bench":
        flags += ["--input-len", "4", "--output-len", "2"]
    assert main([*command, *flags]) == 0
    assert len(selected) == 1 and built_on == selected
