"""An fp8 KV cache with a checkpoint's per-layer scales (compressed-tensors' kv_cache_scheme: `self_attn.k_scale`
and `.v_scale`): the attention layers load them, the cache stores K / k_scale and V / v_scale, every backend reads
them back scaled (common/conformance/test_attention_backends.py checks each backend on each lane), a weight update
may not change them, and a per-head scheme is refused."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from omnirun.devices.cpu.platform import CpuPlatform
from omnirun.errors import ModelLoadError, WeightUpdateError
from omnirun.testing import make_runner
from quantized_checkpoints import prefill_logits, write_fp8_checkpoint

SCALES = {"k": [0.02, 0.7], "v": [1.9, 0.05]}  # per layer: keys and values far from 1 either way


def _checkpoint_with_kv_scales(path, shape=(), scales=SCALES):
    """The tiny compressed-tensors fp8 checkpoint, its k_scale/v_scale tensors set to `scales` (of `shape`)."""
    write_fp8_checkpoint(path, "llama", "channel")
    tensors = load_file(path / "model.safetensors")
    for kv, values in scales.items():
        for layer, value in enumerate(values):
            tensors[f"model.layers.{layer}.self_attn.{kv}_scale"] = torch.full(shape, value)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("shape", [(), (1,)], ids=["scalar", "one-element"])
def test_the_checkpoint_s_scales_reach_the_fp8_cache_and_its_logits_stay_near_the_full_precision_ones(tmp_path, shape):
    _checkpoint_with_kv_scales(tmp_path, shape)
    fp8 = make_runner(CpuPlatform(), tmp_path, kv_cache_dtype="fp8_e4m3")
    full = make_runner(CpuPlatform(), tmp_path)
    try:
        cache = fp8.kv.kv_cache
        assert cache.k_scales == pytest.approx(SCALES["k"]) and cache.v_scales == pytest.approx(SCALES["v"])
        assert fp8.describe()["kv_cache_dtype"] == "float8_e4m3fn (k/v scales from the checkpoint)"
        assert full.describe()["kv_cache_dtype"] == "float32"  # an unscaled cache ignores them
        assert fp8.get_weights_by_name("model.layers.1.self_attn.v_scale").item() == pytest.approx(0.05)
        got, want = prefill_logits(fp8), prefill_logits(full)
        # K 50x (layer 0) and V 20x (layer 1) the fp8 grid's spacing near 1 would give tenfold these errors
        torch.testing.assert_close(got, want, atol=0.05, rtol=0.05)
    finally:
        fp8.close()
        full.close()


def test_a_weight_update_may_not_change_the_scales_an_fp8_cache_stores_with(tmp_path):
    _checkpoint_with_kv_scales(tmp_path)
    runner = make_runner(CpuPlatform(), tmp_path, kv_cache_dtype="fp8_e4m3")
    try:
        with pytest.raises(WeightUpdateError, match=r"^[^\n]*fixed at start-up: leave the k_scale/v_scale tensors out"):
            runner.update_weights_from_tensor([("model.layers.0.self_attn.k_scale", torch.tensor(0.5))])
        assert runner.kv.kv_cache.k_scales[0] == pytest.approx(0.02)
    finally:
        runner.close()
    plain = make_runner(CpuPlatform(), tmp_path)  # a model-dtype cache reads no scale: the update goes in
    try:
        plain.update_weights_from_tensor([("model.layers.0.self_attn.k_scale", torch.tensor(0.5))])
        assert plain.get_weights_by_name("model.layers.0.self_attn.k_scale").item() == 0.5
    finally:
        plain.close()


def test_per_head_kv_cache_scales_are_refused_before_loading(tmp_path):
    _checkpoint_with_kv_scales(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"]["kv_cache_scheme"]["strategy"] = "attn_head"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"kv_cache_scheme strategy 'attn_head' is not supported: .* per-tensor"):
        make_runner(CpuPlatform(), tmp_path, kv_cache_dtype="fp8_e4m3")


def test_a_zero_scale_in_the_checkpoint_is_refused_in_one_line(tmp_path):
    _checkpoint_with_kv_scales(tmp_path, scales={"k": [0.0, 0.7], "v": [1.9, 0.05]})
    with pytest.raises(ModelLoadError, match=r"^the checkpoint's k_scale/v_scale: .*positive and finite; re-export"):
        make_runner(CpuPlatform(), tmp_path, kv_cache_dtype="fp8_e4m3")
