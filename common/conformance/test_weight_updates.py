"""Weight updates: a good one switches the outputs to the new model's; a bad one changes no bit of any parameter."""

from __future__ import annotations

import hashlib
import shutil

import pytest
import torch

from omnirun.batch import build_batch
from omnirun.errors import WeightUpdateError
from omnirun.loader import SafetensorsCheckpoint
from omnirun.testing import make_runner, tiny_hf_model

PROMPT = list(range(3, 40))


def _param_hashes(runner) -> dict[str, str]:
    return {
        name: hashlib.sha256(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
        for name, p in runner.model.named_parameters()
    }


def _logits(runner):
    row = runner.kv.new_request()
    try:
        batch = build_batch(runner.kv, [row], [0], [PROMPT], runner.device, return_full_logits=True)
        return runner.forward(batch).float()
    finally:
        runner.kv.release(row)


def _hf_logits(hf_model, device):
    with torch.no_grad():
        return hf_model.to(device)(torch.tensor([PROMPT], device=device)).logits[0].float()


@pytest.fixture
def runner(tiny_checkpoints, platform):
    return make_runner(platform, tiny_checkpoints["qwen2"].sharded)


@pytest.fixture
def new_checkpoint(tmp_path):
    """The same architecture with other random weights, sharded."""
    model = tiny_hf_model("qwen2", seed=99)
    model.save_pretrained(tmp_path / "new", max_shard_size="40KB")
    return model, tmp_path / "new"


def test_good_update_switches_outputs(runner, new_checkpoint, tiny_checkpoints, platform):
    torch.testing.assert_close(_logits(runner), _hf_logits(tiny_checkpoints["qwen2"].hf_model, runner.device))
    new_model, path = new_checkpoint
    runner.update_weights_from_disk(str(path))
    torch.testing.assert_close(_logits(runner), _hf_logits(new_model, runner.device), atol=1e-4, rtol=0)


def test_corrupt_shard_changes_nothing(runner, new_checkpoint):
    _, path = new_checkpoint
    shard = sorted(path.glob("*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[:-100])  # truncated: the header promises more data than the file holds
    before = _param_hashes(runner)
    with pytest.raises(WeightUpdateError, match="nothing changed.*" + shard.name):
        runner.update_weights_from_disk(str(path))
    assert _param_hashes(runner) == before


def test_misshaped_shard_changes_nothing(runner, tmp_path):
    from transformers import AutoModelForCausalLM

    from omnirun.testing import tiny_configs

    config = tiny_configs()["qwen2"]
    config.intermediate_size = 96
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "other", max_shard_size="40KB")
    before = _param_hashes(runner)
    with pytest.raises(WeightUpdateError, match=r"nothing changed.*shape \[96, 64\].*expects \[128, 64\]"):
        runner.update_weights_from_disk(str(tmp_path / "other"))
    assert _param_hashes(runner) == before


def test_missing_tensor_changes_nothing(runner, new_checkpoint, tmp_path):
    _, path = new_checkpoint
    partial = tmp_path / "partial"
    shutil.copytree(path, partial)
    index = partial / "model.safetensors.index.json"
    index.write_text(index.read_text().replace('"model.norm.weight"', '"model.norm.weight.renamed"'))
    before = _param_hashes(runner)
    with pytest.raises(WeightUpdateError, match="nothing changed"):
        runner.update_weights_from_disk(str(partial))
    assert _param_hashes(runner) == before


def test_failure_half_way_rolls_back_every_bit(runner, new_checkpoint, monkeypatch):
    _, path = new_checkpoint
    real_iter = SafetensorsCheckpoint.iter_tensors

    def fail_after_ten(self, *args, **kwargs):
        for i, item in enumerate(real_iter(self, *args, **kwargs)):
            if i == 10:
                raise OSError("disk went away")
            yield item

    monkeypatch.setattr(SafetensorsCheckpoint, "iter_tensors", fail_after_ten)
    before = _param_hashes(runner)
    logits_before = _logits(runner)
    with pytest.raises(WeightUpdateError, match=r"rolled back \(10 tensors restored\): OSError: disk went away"):
        runner.update_weights_from_disk(str(path))
    assert _param_hashes(runner) == before
    assert torch.equal(_logits(runner), logits_before)


def test_update_from_tensor_and_get_by_name(runner):
    name = "model.layers.1.self_attn.k_proj.weight"  # a shard of the fused qkv projection
    q_name, v_name = name.replace("k_proj", "q_proj"), name.replace("k_proj", "v_proj")
    current = runner.get_weights_by_name(name)
    assert current.shape == (2 * 16, 64)
    q_before, v_before = runner.get_weights_by_name(q_name), runner.get_weights_by_name(v_name)
    new = torch.randn_like(current)
    runner.update_weights_from_tensor([(name, new), ("model.norm.weight", torch.ones(64))])
    assert torch.equal(runner.get_weights_by_name(name), new)
    assert torch.equal(runner.get_weights_by_name(name, truncate_size=3), new[:3])
    assert torch.equal(runner.get_weights_by_name("model.norm.weight"), torch.ones(64, device=runner.device))
    # the q and v rows around the k shard are untouched by writing k, and the fused rows are q | new k | v
    assert torch.equal(runner.get_weights_by_name(q_name), q_before)
    assert torch.equal(runner.get_weights_by_name(v_name), v_before)
    fused = runner.model.model.layers[1].self_attn.qkv_proj.weight
    assert torch.equal(fused, torch.cat([q_before, new, v_before]))

    before = _param_hashes(runner)
    with pytest.raises(WeightUpdateError, match="not a parameter of this model"):
        runner.update_weights_from_tensor([(name, new), ("model.layers.9.mlp.up_proj.weight", new)])
    with pytest.raises(WeightUpdateError, match=r"has shape \[3\]"):
        runner.update_weights_from_tensor([("model.norm.weight", torch.ones(3))])
    assert _param_hashes(runner) == before
    with pytest.raises(WeightUpdateError, match="no weight named"):
        runner.get_weights_by_name("model.nope.weight")
