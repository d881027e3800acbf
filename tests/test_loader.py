"""omnirun.loader: safetensors checkpoints, model configs and presets, dtype/context resolution, dummy weights."""

from __future__ import annotations

import json
import logging
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

from omnirun.errors import ConfigError, ModelLoadError
from omnirun.loader import (
    PRESETS,
    SafetensorsCheckpoint,
    checkpoint_dtype,
    context_length,
    init_dummy_weights,
    load_model_config,
    preset_config,
    preset_names,
    resolve_model_dtype,
)
from omnirun.loader import checkpoint as checkpoint_module
from omnirun.platform import Capabilities
from omnirun.testing import randomize_constant_parameters


def _tiny_config(**overrides) -> LlamaConfig:
    kwargs = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
    )
    return LlamaConfig(**{**kwargs, **overrides})


@pytest.fixture(scope="module")
def tiny_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    model = LlamaForCausalLM(_tiny_config())
    randomize_constant_parameters(model, seed=0)  # norm weights other than ones: a swapped tensor shows
    return model


@pytest.fixture(scope="module")
def plain_dir(tiny_model, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("plain")
    tiny_model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def sharded_dir(tiny_model, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("sharded")
    tiny_model.save_pretrained(path, max_shard_size="20KB")
    return path


def _copy_dir(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for file in src.iterdir():
        (dst / file.name).write_bytes(file.read_bytes())
    return dst


def _caps(*model_dtypes: torch.dtype, name: str = "accel") -> Capabilities:
    return Capabilities(
        device_name=name,
        model_dtypes=tuple(model_dtypes),
        fp8_e4m3_dtype=None,
        fp8_e5m2_dtype=None,
        supports_triton=False,
    )


def _one_line_error(excinfo: pytest.ExceptionInfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    return message


# --- SafetensorsCheckpoint: reading ---


@pytest.mark.parametrize("layout", ["plain", "sharded"])
def test_iter_tensors_returns_exactly_the_state_dict(layout, tiny_model, plain_dir, sharded_dir):
    directory = plain_dir if layout == "plain" else sharded_dir
    ckpt = SafetensorsCheckpoint(directory)
    loaded = dict(ckpt.iter_tensors())
    expected = tiny_model.state_dict()
    assert loaded.keys() == expected.keys()
    for name, tensor in expected.items():
        assert loaded[name].device.type == "cpu"
        assert torch.equal(loaded[name], tensor), name


def test_plain_checkpoint_finds_its_single_file(plain_dir):
    assert SafetensorsCheckpoint(plain_dir).files == [plain_dir / "model.safetensors"]


def test_sharded_checkpoint_takes_its_files_from_the_index(sharded_dir):
    index = json.loads((sharded_dir / "model.safetensors.index.json").read_text())
    expected = sorted({sharded_dir / name for name in index["weight_map"].values()})
    files = SafetensorsCheckpoint(sharded_dir).files
    assert len(files) > 1
    assert files == expected


def test_without_index_all_safetensors_files_are_found_sorted(tmp_path):
    save_file({"b": torch.zeros(2)}, tmp_path / "b.safetensors")
    save_file({"a": torch.ones(3)}, tmp_path / "a.safetensors")
    ckpt = SafetensorsCheckpoint(tmp_path)
    assert ckpt.files == [tmp_path / "a.safetensors", tmp_path / "b.safetensors"]
    assert [name for name, _ in ckpt.iter_tensors()] == ["a", "b"]


def test_iter_tensors_can_read_a_subset(sharded_dir, tiny_model):
    names = ["lm_head.weight", "model.norm.weight"]
    loaded = dict(SafetensorsCheckpoint(sharded_dir).iter_tensors(names))
    assert sorted(loaded) == sorted(names)
    for name in names:
        assert torch.equal(loaded[name], tiny_model.state_dict()[name])


def test_iter_tensors_unknown_name_is_an_error(plain_dir):
    with pytest.raises(ModelLoadError, match="no_such.weight") as excinfo:
        list(SafetensorsCheckpoint(plain_dir).iter_tensors(["no_such.weight"]))
    _one_line_error(excinfo)


def test_iter_tensors_progress_bar(plain_dir, capsys):
    n = len(list(SafetensorsCheckpoint(plain_dir).iter_tensors(progress=True)))
    err = capsys.readouterr().err
    assert "loading weights" in err
    assert f"{n}/{n}" in err


def test_iter_tensors_never_unpickles(plain_dir, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("torch.load must not be called")

    monkeypatch.setattr(torch, "load", refuse)
    assert len(list(SafetensorsCheckpoint(plain_dir).iter_tensors())) > 0


def test_read_errors_name_the_file_and_tensor(plain_dir, monkeypatch):
    class BrokenHandle:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def get_tensor(self, name):
            raise RuntimeError("device error\nsecond line")

    monkeypatch.setattr(checkpoint_module, "safe_open", lambda *a, **k: BrokenHandle())
    with pytest.raises(ModelLoadError) as excinfo:
        list(SafetensorsCheckpoint(plain_dir).iter_tensors(["model.norm.weight"]))
    message = _one_line_error(excinfo)
    assert "model.safetensors" in message and "model.norm.weight" in message and "device error" in message


# --- SafetensorsCheckpoint: headers ---


@pytest.mark.parametrize("layout", ["plain", "sharded"])
def test_tensor_specs_match_without_reading_data(layout, tiny_model, plain_dir, sharded_dir, monkeypatch):
    directory = plain_dir if layout == "plain" else sharded_dir

    def refuse(*args, **kwargs):
        raise AssertionError("tensor_specs must read headers only")

    monkeypatch.setattr(checkpoint_module, "safe_open", refuse)
    specs = SafetensorsCheckpoint(directory).tensor_specs()
    expected = tiny_model.state_dict()
    assert specs.keys() == expected.keys()
    for name, tensor in expected.items():
        spec = specs[name]
        assert spec.name == name
        assert spec.shape == tuple(tensor.shape)
        assert spec.dtype == tensor.dtype
        assert spec.file.parent == directory
        assert spec.nbytes == tensor.numel() * tensor.element_size()


def test_tensor_specs_point_at_the_right_shard(sharded_dir):
    index = json.loads((sharded_dir / "model.safetensors.index.json").read_text())
    specs = SafetensorsCheckpoint(sharded_dir).tensor_specs()
    assert {name: spec.file.name for name, spec in specs.items()} == index["weight_map"]


def test_tensor_specs_dtypes(tmp_path):
    tensors = {
        "bf16": torch.zeros(2, 3, dtype=torch.bfloat16),
        "f16": torch.zeros(4, dtype=torch.float16),
        "i64": torch.zeros(5, dtype=torch.int64),
        "fp8": torch.zeros(2, 2, dtype=torch.float8_e4m3fn),
        "fp8_e5m2": torch.zeros(3, dtype=torch.float8_e5m2),
        "scalar": torch.tensor(1.0),
        "empty": torch.zeros(0, 4),
    }
    save_file(tensors, tmp_path / "model.safetensors")
    ckpt = SafetensorsCheckpoint(tmp_path)
    specs = ckpt.tensor_specs()
    assert {n: (s.shape, s.dtype) for n, s in specs.items()} == {
        n: (tuple(t.shape), t.dtype) for n, t in tensors.items()
    }
    loaded = dict(ckpt.iter_tensors())
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype
        assert torch.equal(loaded[name].float(), tensor.float())


# --- SafetensorsCheckpoint: errors ---


def test_missing_directory(tmp_path):
    with pytest.raises(ModelLoadError, match="does-not-exist") as excinfo:
        SafetensorsCheckpoint(tmp_path / "does-not-exist")
    _one_line_error(excinfo)


def test_no_weights_names_the_directory(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="no weights") as excinfo:
        SafetensorsCheckpoint(tmp_path)
    assert str(tmp_path) in _one_line_error(excinfo)


def test_only_pickled_weights_are_refused_with_a_conversion_hint(tmp_path, tiny_model):
    torch.save(tiny_model.state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(ModelLoadError) as excinfo:
        SafetensorsCheckpoint(tmp_path)
    message = _one_line_error(excinfo)
    assert "pytorch_model.bin" in message
    assert "never unpickles" in message
    assert "safe_serialization=True" in message


def test_index_naming_a_missing_shard(tmp_path, sharded_dir):
    directory = _copy_dir(sharded_dir, tmp_path / "ckpt")
    (directory / "model-00002-of-00007.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="model-00002-of-00007.safetensors") as excinfo:
        SafetensorsCheckpoint(directory)
    _one_line_error(excinfo)


def test_index_disagreeing_with_the_shards(tmp_path, sharded_dir):
    directory = _copy_dir(sharded_dir, tmp_path / "ckpt")
    index_path = directory / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["lm_head.weight"] = "model-00001-of-00007.safetensors"
    if (
        SafetensorsCheckpoint(sharded_dir).tensor_specs()["lm_head.weight"].file.name
        == index["weight_map"]["lm_head.weight"]
    ):
        index["weight_map"]["lm_head.weight"] = "model-00002-of-00007.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match="lm_head.weight") as excinfo:
        SafetensorsCheckpoint(directory).tensor_specs()
    _one_line_error(excinfo)


def test_invalid_index_file(tmp_path, sharded_dir):
    directory = _copy_dir(sharded_dir, tmp_path / "ckpt")
    (directory / "model.safetensors.index.json").write_text('{"metadata": {}}')
    with pytest.raises(ModelLoadError, match="weight_map") as excinfo:
        SafetensorsCheckpoint(directory)
    _one_line_error(excinfo)


def test_truncated_file(tmp_path, plain_dir):
    directory = _copy_dir(plain_dir, tmp_path / "ckpt")
    weights = directory / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) - 100])
    ckpt = SafetensorsCheckpoint(directory)
    with pytest.raises(ModelLoadError, match="truncated") as excinfo:
        ckpt.tensor_specs()
    assert str(weights) in _one_line_error(excinfo)
    # Reading fails up front too, before any tensor is handed out.
    with pytest.raises(ModelLoadError, match="truncated"):
        next(ckpt.iter_tensors())


def test_garbage_header(tmp_path):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(struct.pack("<Q", 16) + b"this is not json" + b"\0" * 64)
    with pytest.raises(ModelLoadError, match="corrupt") as excinfo:
        SafetensorsCheckpoint(tmp_path).tensor_specs()
    assert str(weights) in _one_line_error(excinfo)


def test_header_length_past_the_end_of_the_file(tmp_path):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(struct.pack("<Q", 10**6) + b"{}")
    with pytest.raises(ModelLoadError, match="corrupt") as excinfo:
        SafetensorsCheckpoint(tmp_path).tensor_specs()
    assert str(weights) in _one_line_error(excinfo)


def test_file_shorter_than_the_header_length(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\x01\x02")
    with pytest.raises(ModelLoadError, match="model.safetensors") as excinfo:
        SafetensorsCheckpoint(tmp_path).tensor_specs()
    _one_line_error(excinfo)


def test_header_entry_whose_size_disagrees_with_its_shape(tmp_path):
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 16)
    with pytest.raises(ModelLoadError, match="'w'") as excinfo:
        SafetensorsCheckpoint(tmp_path).tensor_specs()
    _one_line_error(excinfo)


def test_unknown_dtype_in_header(tmp_path):
    header = json.dumps({"w": {"dtype": "F7", "shape": [1], "data_offsets": [0, 1]}}).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0")
    with pytest.raises(ModelLoadError, match="F7") as excinfo:
        SafetensorsCheckpoint(tmp_path).tensor_specs()
    _one_line_error(excinfo)


def test_duplicate_tensor_names_across_files(tmp_path):
    save_file({"w": torch.zeros(2), "a": torch.zeros(1)}, tmp_path / "a.safetensors")
    save_file({"w": torch.ones(2)}, tmp_path / "b.safetensors")
    with pytest.raises(ModelLoadError, match="'w'") as excinfo:
        SafetensorsCheckpoint(tmp_path).tensor_specs()
    message = _one_line_error(excinfo)
    assert "a.safetensors" in message and "b.safetensors" in message


# --- presets ---


def test_preset_llama_3_8b():
    c = preset_config("llama-3-8b")
    assert isinstance(c, transformers.LlamaConfig)
    assert c.architectures == ["LlamaForCausalLM"]
    assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers) == (4096, 14336, 32)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (32, 8, 128)
    assert (c.vocab_size, c.max_position_embeddings, c.rms_norm_eps) == (128256, 8192, 1e-5)
    assert c.rope_parameters == {"rope_type": "default", "rope_theta": 500000.0}
    assert c.dtype == torch.bfloat16
    assert c.tie_word_embeddings is False


def test_preset_llama_3_1_8b():
    c = preset_config("llama-3.1-8b")
    base = preset_config("llama-3-8b")
    assert c.max_position_embeddings == 131072
    assert c.rope_parameters == {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_key_value_heads", "vocab_size"):
        assert getattr(c, key) == getattr(base, key)
    assert c.dtype == torch.bfloat16 and c.tie_word_embeddings is False


def test_preset_qwen2_5_0_5b():
    c = preset_config("qwen2.5-0.5b")
    assert isinstance(c, transformers.Qwen2Config)
    assert c.architectures == ["Qwen2ForCausalLM"]
    assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers) == (896, 4864, 24)
    assert (c.num_attention_heads, c.num_key_value_heads) == (14, 2)
    assert (c.vocab_size, c.max_position_embeddings, c.rms_norm_eps) == (151936, 32768, 1e-6)
    assert c.rope_parameters == {"rope_type": "default", "rope_theta": 1000000.0}
    assert c.tie_word_embeddings is True and c.dtype == torch.bfloat16


def test_preset_qwen3_0_6b():
    c = preset_config("qwen3-0.6b")
    assert isinstance(c, transformers.Qwen3Config)
    assert c.architectures == ["Qwen3ForCausalLM"]
    assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers) == (1024, 3072, 28)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (16, 8, 128)
    assert (c.vocab_size, c.max_position_embeddings, c.rms_norm_eps) == (151936, 40960, 1e-6)
    assert c.rope_parameters == {"rope_type": "default", "rope_theta": 1000000.0}
    assert c.tie_word_embeddings is True and c.dtype == torch.bfloat16


def test_preset_tiny_llama():
    c = preset_config("tiny-llama")
    assert isinstance(c, transformers.LlamaConfig)
    assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers) == (64, 128, 2)
    assert (c.num_attention_heads, c.num_key_value_heads) == (4, 2)
    assert (c.vocab_size, c.max_position_embeddings) == (512, 256)


# Published parameter counts (Hugging Face model cards / safetensors metadata); tied embeddings count once.
@pytest.mark.parametrize(
    "name,model_class,n_params",
    [
        ("llama-3-8b", transformers.LlamaForCausalLM, 8_030_261_248),
        ("llama-3.1-8b", transformers.LlamaForCausalLM, 8_030_261_248),
        ("qwen2.5-0.5b", transformers.Qwen2ForCausalLM, 494_032_768),
        ("qwen3-0.6b", transformers.Qwen3ForCausalLM, 596_049_920),
        ("mistral-7b-v0.3", transformers.MistralForCausalLM, 7_248_023_552),
    ],
)
def test_presets_give_the_published_parameter_counts(name, model_class, n_params):
    with torch.device("meta"):
        model = model_class(preset_config(name))
    assert sum(p.numel() for p in model.parameters()) == n_params


def test_every_preset_builds_with_its_architecture():
    for name in preset_names():
        config = preset_config(name)
        assert len(config.architectures) == 1
        model_class = getattr(transformers, config.architectures[0])
        with torch.device("meta"):
            model_class(config)


def test_preset_config_is_fresh_each_call():
    a = preset_config("tiny-llama")
    a.hidden_size = 7
    a.rope_parameters["rope_theta"] = 1.0
    b = preset_config("tiny-llama")
    assert b.hidden_size == 64 and b.rope_parameters["rope_theta"] == 10000.0


def test_preset_names_and_unknown_preset():
    assert set(preset_names()) == set(PRESETS)
    assert {"llama-3-8b", "llama-3.1-8b", "qwen2.5-0.5b", "qwen3-0.6b", "tiny-llama"} <= set(preset_names())
    with pytest.raises(ModelLoadError, match="llama-3-8b") as excinfo:
        preset_config("llama-9000")
    assert "llama-9000" in _one_line_error(excinfo)


# --- load_model_config ---


@pytest.mark.parametrize("load_format", ["auto", "safetensors", "dummy"])
def test_load_model_config_from_a_directory(plain_dir, load_format):
    config = load_model_config(str(plain_dir), load_format)
    assert isinstance(config, transformers.LlamaConfig)
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (32, 2, 128)
    assert config.dtype == torch.float32


def test_load_model_config_dummy_from_a_directory_without_weights(tmp_path):
    _tiny_config(dtype="bfloat16").save_pretrained(tmp_path)
    assert not list(tmp_path.glob("*.safetensors"))
    config = load_model_config(str(tmp_path), "dummy")
    assert config.hidden_size == 32
    assert checkpoint_dtype(config) == torch.bfloat16


def test_load_model_config_dummy_preset():
    config = load_model_config("qwen3-0.6b", "dummy")
    assert isinstance(config, transformers.Qwen3Config)
    assert config.hidden_size == 1024


def test_load_model_config_dummy_unknown_name(tmp_path):
    with pytest.raises(ModelLoadError) as excinfo:
        load_model_config(str(tmp_path / "nope"), "dummy")
    message = _one_line_error(excinfo)
    assert "nope" in message and "tiny-llama" in message and "config.json" in message


def test_load_model_config_missing_directory(tmp_path):
    with pytest.raises(ModelLoadError) as excinfo:
        load_model_config(str(tmp_path / "missing-model"), "auto")
    assert "missing-model" in _one_line_error(excinfo)


def test_load_model_config_preset_name_without_dummy_hints_at_dummy():
    with pytest.raises(ModelLoadError, match="--load-format dummy") as excinfo:
        load_model_config("llama-3-8b", "auto")
    _one_line_error(excinfo)


@pytest.mark.parametrize("load_format", ["auto", "dummy"])
def test_load_model_config_directory_without_config_json(tmp_path, load_format):
    with pytest.raises(ModelLoadError, match="config.json") as excinfo:
        load_model_config(str(tmp_path), load_format)
    _one_line_error(excinfo)


def test_load_model_config_unknown_load_format(plain_dir):
    with pytest.raises(ConfigError, match="auto|safetensors|dummy") as excinfo:
        load_model_config(str(plain_dir), "pickle")
    assert "auto|safetensors|dummy" in _one_line_error(excinfo)


def test_load_model_config_corrupt_config_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="config.json") as excinfo:
        load_model_config(str(tmp_path), "auto")
    _one_line_error(excinfo)


def test_load_model_config_never_runs_remote_code(tmp_path):
    config = {"model_type": "my_custom_model", "auto_map": {"AutoConfig": "configuration_custom.CustomConfig"}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "configuration_custom.py").write_text("raise SystemExit('remote code ran')\n")
    with pytest.raises(ModelLoadError) as excinfo:
        load_model_config(str(tmp_path), "auto")
    _one_line_error(excinfo)


# --- resolve_model_dtype ---

GPU_LIKE = _caps(torch.bfloat16, torch.float16, torch.float32, name="gpu-like")
NO_BF16 = _caps(torch.float16, torch.float32, name="old-gpu")
FP32_ONLY = _caps(torch.float32, name="fp32-only")


@pytest.mark.parametrize(
    "saved,caps,expected",
    [
        (torch.bfloat16, GPU_LIKE, torch.bfloat16),
        ("bfloat16", GPU_LIKE, torch.bfloat16),
        ("torch.float16", GPU_LIKE, torch.float16),
        (torch.float32, GPU_LIKE, torch.float32),
        (torch.bfloat16, NO_BF16, torch.float16),
        (torch.bfloat16, FP32_ONLY, torch.float32),
        (None, GPU_LIKE, torch.bfloat16),
        (None, NO_BF16, torch.float16),
        (torch.float8_e4m3fn, GPU_LIKE, torch.bfloat16),
    ],
)
def test_resolve_auto_dtype(saved, caps, expected):
    config = _tiny_config()
    config.dtype = saved  # set after construction: the constructor rejects some spellings that config files hold
    assert resolve_model_dtype("auto", config, caps) == expected


def test_resolve_auto_dtype_reads_the_saved_config(tmp_path):
    _tiny_config(dtype="float16").save_pretrained(tmp_path)
    assert resolve_model_dtype("auto", load_model_config(str(tmp_path), "auto"), GPU_LIKE) == torch.float16


@pytest.mark.parametrize(
    "name,expected",
    [
        ("float32", torch.float32),
        ("fp32", torch.float32),
        ("bfloat16", torch.bfloat16),
        ("bf16", torch.bfloat16),
        ("float16", torch.float16),
        ("fp16", torch.float16),
        ("half", torch.float16),
    ],
)
def test_resolve_explicit_dtype(name, expected):
    assert resolve_model_dtype(name, _tiny_config(dtype="float32"), GPU_LIKE) == expected


def test_resolve_explicit_dtype_unsupported_on_the_device():
    with pytest.raises(ConfigError) as excinfo:
        resolve_model_dtype("bf16", _tiny_config(), NO_BF16)
    message = _one_line_error(excinfo)
    assert "old-gpu" in message and "float16" in message and "float32" in message


def test_resolve_unknown_dtype_name():
    with pytest.raises(ConfigError, match="float64") as excinfo:
        resolve_model_dtype("float64", _tiny_config(), GPU_LIKE)
    assert "bfloat16" in _one_line_error(excinfo)


# --- context_length ---


def test_context_length_defaults_to_max_position_embeddings():
    assert context_length(_tiny_config(max_position_embeddings=4096), None) == 4096


def test_context_length_override_below_the_native_length():
    assert context_length(_tiny_config(max_position_embeddings=4096), 1024) == 1024


def test_context_length_override_above_the_native_length_is_refused_unless_allowed(monkeypatch, caplog):
    monkeypatch.delenv("OMNIRUN_ALLOW_LONG_CONTEXT", raising=False)
    with pytest.raises(ConfigError, match="--context-length 8192 exceeds .* 4096: use at most 4096") as excinfo:
        context_length(_tiny_config(max_position_embeddings=4096), 8192)
    _one_line_error(excinfo)
    monkeypatch.setenv("OMNIRUN_ALLOW_LONG_CONTEXT", "true")
    with caplog.at_level(logging.WARNING, logger="omnirun.loader.model_config"):
        assert context_length(_tiny_config(max_position_embeddings=4096), 8192) == 8192
    assert any("8192" in r.getMessage() and "4096" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("bad", [0, -5])
def test_context_length_override_must_be_positive(bad):
    with pytest.raises(ConfigError, match="--context-length") as excinfo:
        context_length(_tiny_config(), bad)
    _one_line_error(excinfo)


# --- init_dummy_weights ---


class _Block(torch.nn.Module):
    def __init__(self, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.proj = torch.nn.Linear(16, 8, dtype=dtype)
        self.input_layernorm = torch.nn.Module()
        self.input_layernorm.weight = torch.nn.Parameter(torch.zeros(16, dtype=dtype))
        self.q_norm = torch.nn.Module()
        self.q_norm.weight = torch.nn.Parameter(torch.zeros(4, dtype=dtype))


class _ModelAB(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = _Block()
        self.b = _Block()
        self.norm = torch.nn.Module()
        self.norm.weight = torch.nn.Parameter(torch.zeros(16))


class _ModelBA(torch.nn.Module):
    """The same parameter names as _ModelAB, registered in the opposite order."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.Module()
        self.norm.weight = torch.nn.Parameter(torch.zeros(16))
        self.b = _Block()
        self.a = _Block()


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_dummy_weights_do_not_depend_on_module_order():
    ab, ba = _ModelAB(), _ModelBA()
    assert list(dict(ab.named_parameters())) != list(dict(ba.named_parameters()))
    init_dummy_weights(ab, seed=1)
    init_dummy_weights(ba, seed=1)
    pa, pb = _params(ab), _params(ba)
    assert pa.keys() == pb.keys()
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name


def test_dummy_weights_differ_for_another_seed_and_between_parameters():
    one, two = _ModelAB(), _ModelAB()
    init_dummy_weights(one, seed=1)
    init_dummy_weights(two, seed=2)
    assert not torch.equal(one.a.proj.weight, two.a.proj.weight)
    assert not torch.equal(one.a.proj.bias, two.a.proj.bias)
    # Same shape, different names: different values.
    assert not torch.equal(one.a.proj.weight, one.b.proj.weight)


def test_dummy_weights_norms_are_ones_and_weights_small_normals():
    model = _ModelAB()
    init_dummy_weights(model, seed=0)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p)), name
        else:
            assert p.abs().max() < 0.2, name
            assert p.std() > 0, name


def test_dummy_weights_on_a_tiny_llama_preset():
    config = preset_config("tiny-llama")
    torch.manual_seed(123)
    first = LlamaForCausalLM(config)
    torch.manual_seed(456)
    second = LlamaForCausalLM(config)
    init_dummy_weights(first, seed=7)
    init_dummy_weights(second, seed=7)
    p1, p2 = _params(first), _params(second)
    n_norms = 0
    for name in p1:
        assert torch.equal(p1[name], p2[name]), name
        if name.endswith("norm.weight"):
            n_norms += 1
            assert torch.equal(p1[name], torch.ones_like(p1[name])), name
    assert n_norms == 2 * config.num_hidden_layers + 1
    big = p1["model.embed_tokens.weight"]
    assert abs(big.std().item() - 0.02) < 0.002
    assert abs(big.mean().item()) < 0.002
    # Buffers (rotary inverse frequencies) keep their computed values.
    for (name, b1), (_, b2) in zip(first.named_buffers(), second.named_buffers(), strict=True):
        assert torch.equal(b1, b2), name


def test_dummy_weights_belong_to_the_checkpoint_names_not_to_the_fused_parameters():
    # The rule: every HF checkpoint tensor is drawn whole from (seed, its name). So omnirun's decoder (q/k/v and
    # gate/up fused, and split under tensor parallelism) holds exactly the values HF's model gets from the same rule.
    from omnirun.layers.ops import Ops
    from omnirun.models.architecture import decoder_shape
    from omnirun.models.decoder import DecoderForCausalLM
    from omnirun.weights import read_weight

    config = _tiny_config(architectures=["LlamaForCausalLM"])
    ours = DecoderForCausalLM(decoder_shape(config), config, max_positions=64, ops=Ops(), dtype=torch.float32)
    hf = LlamaForCausalLM(config)
    init_dummy_weights(ours, seed=7)
    init_dummy_weights(hf, seed=7)
    expected = hf.state_dict()
    for name in ours.checkpoint_names():
        assert torch.equal(read_weight(ours, name), expected[name]), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn])
def test_dummy_weights_keep_the_parameter_dtype(dtype):
    model = torch.nn.Module()
    model.weight = torch.nn.Parameter(torch.zeros(64, 64, dtype=dtype), requires_grad=False)
    model.final_norm = torch.nn.Module()
    model.final_norm.weight = torch.nn.Parameter(torch.zeros(64, dtype=dtype), requires_grad=False)
    init_dummy_weights(model, seed=3)
    assert model.weight.dtype == dtype
    assert model.weight.float().std() > 0.01
    assert torch.equal(model.final_norm.weight.float(), torch.ones(64))


def test_dummy_weights_are_the_same_in_another_process():
    # Stable across processes whatever PYTHONHASHSEED is (Python's hash() is salted per process).
    script = (
        "import torch\nfrom omnirun.loader.dummy import init_dummy_weights\n"
        "m = torch.nn.Linear(8, 4)\ninit_dummy_weights(m, seed=5)\n"
        "print(repr(m.weight.flatten().tolist() + m.bias.tolist()))\n"
    )
    outputs = set()
    for hash_seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, env=env)
        outputs.add(result.stdout)
    assert len(outputs) == 1
    m = torch.nn.Linear(8, 4)
    init_dummy_weights(m, seed=5)
    assert outputs == {repr(m.weight.flatten().tolist() + m.bias.tolist()) + "\n"}


def test_safetensors_dtype_names_are_the_format_s_own():
    from safetensors.torch import _TYPES  # the safetensors package's own name -> torch dtype table

    ours = checkpoint_module._safetensors_dtypes()
    assert {name: ours[name] for name in _TYPES} == _TYPES
    assert set(ours) - set(_TYPES) <= {"F8_E8M0"}  # newer than this safetensors release, where torch has it
