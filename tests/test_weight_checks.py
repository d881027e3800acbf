"""Start-up refuses a checkpoint that does not fill the model exactly: a missing tensor, a tensor of the right size
but the wrong shape, a tensor the model does not have, a dtype a cast would garble. Each is one line naming a fix."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from omnirun.devices.cpu.platform import CpuPlatform
from omnirun.errors import ModelLoadError, WeightUpdateError
from omnirun.layers.ops import Ops
from omnirun.models.architecture import decoder_shape
from omnirun.models.decoder import DecoderForCausalLM
from omnirun.testing import make_runner, tiny_configs, tiny_hf_model
from omnirun.weights import apply_update, check_update, load_weights

ARCH = "qwen2"  # fused q/k/v and gate/up shards, biases and norms: every kind of target


@pytest.fixture(scope="module")
def hf_tensors() -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in tiny_hf_model(ARCH).state_dict().items()}


def _model() -> DecoderForCausalLM:
    config = tiny_configs()[ARCH]
    return DecoderForCausalLM(decoder_shape(config), config, max_positions=64, ops=Ops(), dtype=torch.float32)


def _load(tensors: dict[str, torch.Tensor]) -> DecoderForCausalLM:
    model = _model()
    with torch.no_grad():
        load_weights(model, tensors.items())
    return model


def _one_line(excinfo: pytest.ExceptionInfo) -> str:
    assert "\n" not in str(excinfo.value)
    return str(excinfo.value)


def test_a_complete_checkpoint_fills_every_parameter_with_its_own_tensor(hf_tensors):
    model = _load(hf_tensors)
    for name, tensor in hf_tensors.items():
        target = model.checkpoint_target(name)
        if target is not None:
            assert torch.equal(target.view, tensor), name
    # nothing left as torch.empty() garbage: every fused row came from some checkpoint tensor
    assert sum(model.checkpoint_target(n).view.numel() for n in model.checkpoint_names()) == sum(
        p.numel() for p in model.parameters()
    )


def test_a_missing_tensor_is_refused(hf_tensors):
    tensors = {n: t for n, t in hf_tensors.items() if n != "model.layers.1.self_attn.v_proj.bias"}
    with pytest.raises(ModelLoadError) as excinfo:
        _load(tensors)
    message = _one_line(excinfo)
    assert "lacks 1 tensors" in message and "model.layers.1.self_attn.v_proj.bias" in message
    assert "every shard downloaded" in message


def test_same_element_count_in_another_shape_is_refused(hf_tensors):
    name = "model.layers.0.mlp.gate_proj.weight"
    assert hf_tensors[name].shape == (128, 64)
    tensors = {**hf_tensors, name: hf_tensors[name].reshape(64, 128)}
    with pytest.raises(ModelLoadError) as excinfo:
        _load(tensors)
    assert f"'{name}' has shape [64, 128], the model expects [128, 64]" in _one_line(excinfo)
    assert "config.json" in _one_line(excinfo)


def test_a_tensor_the_model_lacks_is_refused(hf_tensors):
    tensors = {**hf_tensors, "model.layers.0.mlp.extra_proj.weight": torch.zeros(4, 4)}
    with pytest.raises(ModelLoadError, match="'model.layers.0.mlp.extra_proj.weight' is not a parameter"):
        _load(tensors)
    # a projection the architecture has, but without a bias in this model (qwen2's o_proj has none)
    tensors = {**hf_tensors, "model.layers.0.self_attn.o_proj.bias": torch.zeros(64)}
    with pytest.raises(ModelLoadError, match="o_proj.bias' is not a parameter"):
        _load(tensors)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int8, torch.bool, torch.float8_e4m3fn])
def test_a_dtype_a_cast_would_garble_is_refused(hf_tensors, dtype):
    name = "model.layers.0.self_attn.k_proj.weight"
    tensors = {**hf_tensors, name: hf_tensors[name].to(dtype)}
    with pytest.raises(ModelLoadError) as excinfo:
        _load(tensors)
    message = _one_line(excinfo)
    assert f"'{name}' is stored as {str(dtype).removeprefix('torch.')}" in message
    assert "dequantize" in message


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_other_float_widths_are_cast(hf_tensors, dtype):
    name = "model.norm.weight"
    model = _load({**hf_tensors, name: hf_tensors[name].to(dtype)})
    assert torch.equal(model.checkpoint_target(name).view, hf_tensors[name].to(dtype).float())


def test_updates_check_the_same_things(hf_tensors):
    model = _load(hf_tensors)
    name = "model.layers.0.mlp.gate_proj.weight"
    with pytest.raises(WeightUpdateError, match=r"has shape \[64, 128\], the model expects \[128, 64\]"):
        check_update(model, {name: (64, 128)}, complete=False)
    with pytest.raises(WeightUpdateError, match="lacks 1 tensors"):
        check_update(model, {n: tuple(t.shape) for n, t in hf_tensors.items() if n != name}, complete=True)
    before = {n: p.clone() for n, p in model.named_parameters()}
    bad = [("model.norm.weight", torch.ones(64)), (name, hf_tensors[name].to(torch.int32))]
    with pytest.raises(WeightUpdateError, match=r"rolled back \(1 tensors restored\).*stored as int32"):
        with torch.no_grad():
            apply_update(model, bad)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


@pytest.mark.parametrize("case", ["missing", "reshaped", "extra", "int"])
def test_runner_start_up_refuses_a_bad_checkpoint(case, hf_tensors, tmp_path):
    """The same refusals through ModelRunner, from a safetensors file on disk."""
    tensors = dict(hf_tensors)
    if case == "missing":
        del tensors["model.norm.weight"]
    elif case == "reshaped":
        tensors["model.layers.1.mlp.up_proj.weight"] = tensors["model.layers.1.mlp.up_proj.weight"].reshape(64, 128)
    elif case == "extra":
        tensors["model.layers.2.mlp.up_proj.weight"] = torch.zeros(128, 64)
    else:
        tensors["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].to(torch.int64)
    tiny_configs()[ARCH].save_pretrained(tmp_path)
    save_file({n: t.contiguous() for n, t in tensors.items()}, tmp_path / "model.safetensors")
    expected = {
        "missing": r"lacks 1 tensors.*model\.norm\.weight",
        "reshaped": r"up_proj\.weight' has shape \[64, 128\]",
        "extra": r"model\.layers\.2\.mlp\.up_proj\.weight' is not a parameter",
        "int": r"embed_tokens\.weight' is stored as int64",
    }[case]
    with pytest.raises(ModelLoadError, match=expected) as excinfo:
        make_runner(CpuPlatform(), tmp_path)
    _one_line(excinfo)
