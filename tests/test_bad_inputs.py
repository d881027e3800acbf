"""Every bad input a user can give — CLI flags, LLM(...) keywords, SamplingParams, prompts, weight-update paths,
the device — gets a one-line error naming the bad value and the fix, before any work starts, and an LLM that
refused something stays usable."""

from __future__ import annotations

import pytest

from omnirun.cli import main
from omnirun.engine import LLM
from omnirun.errors import (
    ConfigError,
    DeviceUnavailableError,
    DistributedInitError,
    KVPoolTooSmallError,
    ModelLoadError,
    OmnirunError,
    SamplingParamsError,
    UnknownDeviceError,
    WeightUpdateError,
)
from omnirun.runner import ModelRunner
from omnirun.sampling import SamplingParams


@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if a model's weights start to load: the error must come first."""

    def refuse(self):
        raise AssertionError("the weights started to load before the bad input was reported")

    monkeypatch.setattr(ModelRunner, "_load_model", refuse)


@pytest.fixture
def bad_model_dirs(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    broken_json = tmp_path / "broken_json"
    broken_json.mkdir()
    (broken_json / "config.json").write_text("{not json")
    no_tokenizer = tmp_path / "no_tokenizer"
    no_tokenizer.mkdir()
    (no_tokenizer / "vocab.txt").write_text("a\n")
    return {"empty": empty, "broken_json": broken_json, "no_tokenizer": no_tokenizer, "missing": tmp_path / "nope"}


# (LLM keyword arguments, error type, text the one-line message must contain)
LLM_CASES = [
    (dict(page_size=0), ConfigError, "--page-size must be >= 1, got 0"),
    (dict(mem_fraction_static=1.5), ConfigError, "--mem-fraction-static must be in (0, 1], got 1.5"),
    (dict(mem_fraction_static=0.0), ConfigError, "--mem-fraction-static must be in (0, 1], got 0.0"),
    (dict(max_total_tokens=10), KVPoolTooSmallError, "--max-total-tokens 10 cannot hold one request"),
    (dict(max_running_requests=0), ConfigError, "--max-running-requests must be >= 1, got 0"),
    (dict(context_length=0), ConfigError, "--context-length must be >= 1, got 0"),
    (
        dict(context_length=100000),
        ConfigError,
        "--context-length 100000 exceeds the model's max_position_embeddings 1024: use at most 1024, or set "
        "OMNIRUN_ALLOW_LONG_CONTEXT=1",
    ),
    (dict(max_graph_batch_size=0), ConfigError, "--max-graph-batch-size must be >= 1, got 0"),
    (dict(dtype="float64"), ConfigError, "--dtype 'float64' is unknown"),
    (dict(load_format="pt"), ConfigError, "--load-format 'pt' is unknown"),
    (dict(kv_cache_dtype="int4"), ConfigError, "--kv-cache-dtype 'int4' is unknown"),
    (dict(attention_backend="flash"), ConfigError, "--attention-backend 'flash' is not offered"),
    (dict(decode_attention_backend="flash"), ConfigError, "--decode-attention-backend 'flash' is not offered"),
    (dict(max_prefill_tokens=0), ConfigError, "--max-prefill-tokens must be >= 1, got 0"),
    (dict(chunked_prefill_size=-4), ConfigError, "--chunked-prefill-size must be >= 1, got -4"),
    (dict(tp_size=0), ConfigError, "--tp-size must be >= 1, got 0"),
    (dict(tp_size=3), ConfigError, "--tp-size 3 does not divide the model's 4 attention heads: use one of 1, 2, 4"),
    (dict(tp_size=2, nnodes=2), DistributedInitError, "--nnodes 2 needs --dist-init-addr HOST:PORT"),
    (dict(tp_size=2, dist_init_addr="node0"), DistributedInitError, "--dist-init-addr 'node0' is not HOST:PORT"),
    (dict(dist_timeout=0), ConfigError, "--dist-timeout must be > 0 seconds, got 0"),
    (dict(max_num_seqs=3), ConfigError, "unknown LLM argument(s) max_num_seqs"),
    (dict(device="bogus"), UnknownDeviceError, "unknown device 'bogus'"),
    (dict(device="npu"), DeviceUnavailableError, "device 'npu' is unavailable: torch-npu is not installed"),
    (dict(tokenizer="/nonexistent/tok"), ConfigError, "--tokenizer /nonexistent/tok: no such directory"),
]


@pytest.mark.parametrize(
    ("kwargs", "error", "text"), LLM_CASES, ids=["-".join(f"{k}={v}" for k, v in c[0].items()) for c in LLM_CASES]
)
def test_bad_llm_arguments_fail_before_the_model_loads(no_model_load, kwargs, error, text):
    kwargs = {"device": "cpu", **kwargs}
    with pytest.raises(error) as caught:
        LLM(**kwargs)
    message = str(caught.value)
    assert text in message and "\n" not in message


@pytest.mark.parametrize(
    ("model", "error", "text"),
    [
        ("missing", ModelLoadError, "nope"),
        ("empty", ModelLoadError, "config.json"),
        ("broken_json", ModelLoadError, "config.json"),
    ],
)
def test_bad_model_directories(bad_model_dirs, no_model_load, model, error, text):
    with pytest.raises(error, match=text) as caught:
        LLM(str(bad_model_dirs[model]), device="cpu")
    assert "\n" not in str(caught.value)


def test_a_tokenizer_directory_without_a_tokenizer(bad_model_dirs, no_model_load):
    with pytest.raises(ConfigError, match="holds no tokenizer .* give an HF tokenizer directory"):
        LLM(device="cpu", tokenizer=str(bad_model_dirs["no_tokenizer"]))


# (SamplingParams keyword arguments, the field the message names)
SAMPLING_CASES = [
    (dict(max_new_tokens=-1), "max_new_tokens=-1"),
    (dict(max_new_tokens=-3), "max_new_tokens=-3"),
    (dict(max_new_tokens=2.5), "max_new_tokens=2.5"),
    (dict(temperature=-0.1), "temperature=-0.1"),
    (dict(temperature=float("nan")), "temperature=nan"),
    (dict(top_p=0.0), "top_p=0.0"),
    (dict(top_p=1.5), "top_p=1.5"),
    (dict(top_k=-2), "top_k=-2"),
    (dict(top_k=True), "top_k=True"),
    (dict(min_p=-0.1), "min_p=-0.1"),
    (dict(min_p=1.5), "min_p=1.5"),
    (dict(seed="x"), "seed='x'"),
    (dict(logprobs=-1), "logprobs=-1"),
    (dict(stop=""), "stop=''"),
    (dict(stop=[1]), "stop=[1]"),
    (dict(stop_token_ids=[-1]), "stop_token_ids=[-1]"),
    (dict(ignore_eos="yes"), "ignore_eos='yes'"),
]


@pytest.mark.parametrize(("kwargs", "text"), SAMPLING_CASES, ids=[str(c[0]) for c in SAMPLING_CASES])
def test_bad_sampling_params(kwargs, text):
    with pytest.raises(SamplingParamsError) as caught:
        SamplingParams(**kwargs)
    message = str(caught.value)
    assert text in message and "use " in message and "\n" not in message


@pytest.fixture(scope="module")
def llm():
    with LLM(device="cpu", max_total_tokens=2048, dtype="float32") as llm:
        yield llm


PROMPT_CASES = [
    ("", SamplingParams(), "empty prompt"),
    ([], SamplingParams(), "empty prompt"),
    ([-1, 5], SamplingParams(), "token id -1 is outside the model's vocabulary: use ids in [0, 512)"),
    ([5, 512], SamplingParams(), "token id 512 is outside"),
    ([1.5, 2], SamplingParams(), "a prompt is a string or a list of int token ids, got 1.5 (float) at position 0"),
    ([1, None], SamplingParams(), "a prompt is a string or a list of int token ids, got None (NoneType) at position 1"),
    (3.5, SamplingParams(), "a prompt is a string or a list of int token ids, got 3.5 (float)"),
    (b"hi", SamplingParams(), "a prompt is a string or a list of int token ids, got b'hi' (bytes)"),
    ([1] * 1024, SamplingParams(), "the prompt has 1024 tokens, the context length is 1024"),
    ([1] * 1000, SamplingParams(max_new_tokens=100), "use max_new_tokens <= 24"),
]


@pytest.mark.parametrize(("prompt", "params", "text"), PROMPT_CASES, ids=[c[2][:24] for c in PROMPT_CASES])
def test_bad_prompts_are_refused_and_the_llm_stays_usable(llm, prompt, params, text):
    with pytest.raises(ConfigError) as caught:
        llm.generate(["Hello", prompt], params, use_tqdm=False)  # one bad prompt refuses the whole call
    assert text in str(caught.value) and "\n" not in str(caught.value)
    usage = llm.kv_usage()
    queued = usage.pages_held or usage.pages_free + usage.pages_cached != usage.pages_total or llm.engine.requests
    assert not queued, "nothing of the call may be queued"
    with pytest.raises(ConfigError, match=text[:12]):
        llm.stream(prompt, params)
    assert len(llm.generate("Hello", SamplingParams(max_new_tokens=4), use_tqdm=False)[0].token_ids) == 4


def test_a_prompt_that_is_neither_text_nor_ids_is_named(llm):
    with pytest.raises(ConfigError) as caught:
        llm.generate([3.5], use_tqdm=False)
    assert str(caught.value) == "a prompt is a string or a list of int token ids, got 3.5 (float)"
    with pytest.raises(ConfigError, match=r"got \[0, 0, 0, .*\.\.\. \(list\) at position 0$") as caught:
        llm.generate([[1, 2], [[0] * 10_000]], use_tqdm=False)  # a list nested in a prompt
    assert len(str(caught.value)) < 150, "a huge value is cut short"


def test_a_long_context_is_allowed_on_purpose_with_a_warning(monkeypatch, caplog):
    monkeypatch.setenv("OMNIRUN_ALLOW_LONG_CONTEXT", "1")
    with caplog.at_level("WARNING", logger="omnirun.loader.model_config"):
        with LLM(device="cpu", context_length=2048, max_total_tokens=2048) as llm:
            assert llm.runner.context_length == 2048
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("--context-length 2048 exceeds the model's max_position_embeddings 1024" in m for m in warned)
    monkeypatch.setenv("OMNIRUN_ALLOW_LONG_CONTEXT", "0")  # only 1 (or true) allows it
    with pytest.raises(ConfigError, match="set OMNIRUN_ALLOW_LONG_CONTEXT=1"):
        LLM(device="cpu", context_length=2048)


def test_a_missing_model_directory_is_said_before_the_missing_tokenizer(no_model_load, capsys):
    assert main(["generate", "--device", "cpu", "--model", "/nonexistent/model"]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and "tokenizer" not in err


def test_a_stop_string_at_the_start_of_the_output_is_cut(llm):
    free = llm.generate("Hello", SamplingParams(temperature=0, max_new_tokens=8), use_tqdm=False)[0]
    stop = free.text[:2]
    cut = llm.generate("Hello", SamplingParams(temperature=0, max_new_tokens=8, stop=stop), use_tqdm=False)[0]
    assert (cut.text, cut.finish_reason) == ("", "stop")
    streamed = list(llm.stream("Hello", SamplingParams(temperature=0, max_new_tokens=8, stop=stop)))
    assert "".join(d.text for d in streamed) == "" and streamed[-1].finish_reason == "stop"


def test_bad_weight_update_paths_change_nothing(llm, tmp_path):
    before = llm.generate("Hello", SamplingParams(temperature=0, max_new_tokens=6), use_tqdm=False)[0].token_ids
    for path in (tmp_path / "nope", tmp_path):
        with pytest.raises(WeightUpdateError, match="nothing changed") as caught:
            llm.update_weights_from_disk(str(path))
        assert "\n" not in str(caught.value)
    with pytest.raises(WeightUpdateError):
        llm.update_weights_from_tensor([("model.norm.weight", llm.get_weights_by_name("model.norm.weight")[:3])])
    after = llm.generate("Hello", SamplingParams(temperature=0, max_new_tokens=6), use_tqdm=False)[0].token_ids
    assert after == before


# --- the command line: exit code 2 and one line on stderr, before the model loads ---
CLI_CASES = [
    (["generate", "--temperature", "-1"], "temperature=-1.0"),
    (["generate", "--top-p", "0"], "top_p=0.0"),
    (["generate", "--top-k", "-5"], "top_k=-5"),
    (["generate", "--min-p", "2"], "min_p=2.0"),
    (["generate", "--max-new-tokens", "-1"], "max_new_tokens=-1"),
    (["generate", "--page-size", "0"], "--page-size must be >= 1, got 0"),
    (["generate", "--mem-fraction-static", "2"], "--mem-fraction-static must be in (0, 1], got 2.0"),
    (["generate", "--max-total-tokens", "10"], "--max-total-tokens 10 cannot hold"),
    (["generate", "--kv-cache-dtype", "int4"], "--kv-cache-dtype 'int4' is unknown"),
    (["generate", "--attention-backend", "nope"], "--attention-backend 'nope' is not offered"),
    (["generate", "--tokenizer", "/nonexistent/tok"], "--tokenizer /nonexistent/tok: no such directory"),
    (["generate", "--model", "tiny-llama", "--load-format", "dummy"], "has no tokenizer for text prompts"),
    (
        ["generate", "--model", "/nonexistent/model"],
        "model directory /nonexistent/model does not exist: pass --model <dir with config.json>",
    ),
    (["generate", "--model", "tiny-llama"], "(to run the 'tiny-llama' preset with random weights add --load-format"),
    (["bench", "--model", "/nonexistent/model"], "model directory /nonexistent/model does not exist"),
    (["generate", "--context-length", "100000"], "--context-length 100000 exceeds the model's max_position_embeddings"),
    (
        ["generate", "--stream", "--prompt", "a", "--prompt", "b"],
        "--stream prints one prompt as it is generated, got 2 prompts: give one --prompt",
    ),
    (["generate", "--device", "bogus"], "unknown device 'bogus'"),
    (["bench", "--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    (["bench", "--json", "/nonexistent/dir/out.json"], "--json /nonexistent/dir/out.json: its folder does not exist"),
]


@pytest.mark.parametrize(("argv", "text"), CLI_CASES, ids=[" ".join(c[0][1:3]) for c in CLI_CASES])
def test_bad_cli_flags_exit_2_with_one_line(no_model_load, capsys, argv, text):
    assert main([*argv[:1], "--device", "cpu", *argv[1:]] if "--device" not in argv else argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("omnirun: error:") and text in err and err.count("\n") == 1, err


@pytest.mark.parametrize("value", ["bogus", "npu"])
@pytest.mark.parametrize("command", ["generate", "bench"])
def test_omnirun_device_is_honoured_by_every_command(no_model_load, monkeypatch, capsys, command, value):
    monkeypatch.setenv("OMNIRUN_DEVICE", value)
    assert main([command]) == 2
    err = capsys.readouterr().err
    expected = "unknown device 'bogus' (from OMNIRUN_DEVICE)" if value == "bogus" else "device 'npu' is unavailable"
    assert expected in err and err.count("\n") == 1
    with pytest.raises(OmnirunError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        LLM()


def test_cli_sampling_flags_reach_the_request(monkeypatch, capsys):
    seen = {}
    real_generate = LLM.generate

    def recording_generate(self, prompts, params=None, **kwargs):
        seen["params"] = params
        return real_generate(self, prompts, params, **kwargs)

    monkeypatch.setattr(LLM, "generate", recording_generate)
    argv = ["generate", "--device", "cpu", "--max-total-tokens", "2048", "--max-new-tokens", "5"]
    argv += ["--temperature", "0.7", "--top-p", "0.8", "--top-k", "9", "--min-p", "0.05", "--sampling-seed", "3"]
    assert main([*argv, "--stop", "xyz", "--ignore-eos"]) == 0
    params = seen["params"]
    assert (params.temperature, params.top_p, params.top_k, params.min_p, params.seed) == (0.7, 0.8, 9, 0.05, 3)
    assert (params.max_new_tokens, params.stop, params.ignore_eos) == (5, ["xyz"], True)
    capsys.readouterr()


def test_version(capsys):
    with pytest.raises(SystemExit) as caught:
        main(["--version"])
    assert caught.value.code == 0
    from importlib.metadata import version

    assert capsys.readouterr().out.strip() == f"omnirun {version('omnirun')}"
