"""Weight updates and reads: an update of a tied model whose checkpoint holds the
skipped tensors (the tied lm_head, rotary inv_freq) in the middle goes on past them; read_weight returns a copy of
the right rows and names what it cannot read."""

from __future__ import annotations

import pytest
import torch

from omnirun.errors import WeightUpdateError
from omnirun.layers.ops import Ops
from omnirun.models.architecture import decoder_shape
from omnirun.models.decoder import DecoderForCausalLM
from omnirun.testing import tiny_configs, tiny_hf_model
from omnirun.weights import apply_update, load_weights, read_weight

ARCH = "qwen3"  # tie_word_embeddings=True in the tiny config: lm_head.weight is in the checkpoint but skipped


@pytest.fixture(scope="module")
def hf_tensors() -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in tiny_hf_model(ARCH).state_dict().items()}


def _loaded(tensors: dict[str, torch.Tensor]) -> DecoderForCausalLM:
    config = tiny_configs()[ARCH]
    model = DecoderForCausalLM(decoder_shape(config), config, max_positions=64, ops=Ops(), dtype=torch.float32)
    with torch.no_grad():
        load_weights(model, tensors.items())
    return model


def test_an_update_goes_on_past_the_tensors_a_tied_model_skips(hf_tensors):
    model = _loaded(hf_tensors)
    assert model.lm_head.tied and "lm_head.weight" in hf_tensors
    # New values for every tensor: the old ones plus a different constant per tensor, so nothing equals its old value.
    new = {name: t + (i + 1) for i, (name, t) in enumerate(hf_tensors.items())}
    new["lm_head.weight"] = new["model.embed_tokens.weight"]  # a tied checkpoint stores the same tensor twice
    names = [n for n in hf_tensors if n != "lm_head.weight"]
    middle = len(names) // 2
    inv_freq = ("model.layers.0.self_attn.rotary_emb.inv_freq", torch.ones(16))  # old checkpoints carry these
    order = [(n, new[n]) for n in names[:middle]]
    order += [("lm_head.weight", new["lm_head.weight"]), inv_freq]
    order += [(n, new[n]) for n in names[middle:]]
    assert order[-1][0] != "lm_head.weight" and len(names) - middle >= 5

    with torch.no_grad():
        copied = apply_update(model, order)

    assert copied == len(names)  # the two skipped tensors are not counted
    for name in names:
        assert torch.equal(model.checkpoint_target(name).view, new[name]), name
    # the tied head reads the updated embedding
    assert torch.equal(model.lm_head.weight, new["model.embed_tokens.weight"])


def test_read_weight_returns_a_copy_of_the_rows_of_one_shard(hf_tensors):
    model = _loaded(hf_tensors)
    for name in ("model.layers.1.self_attn.v_proj.weight", "model.layers.0.mlp.up_proj.weight", "model.norm.weight"):
        value = read_weight(model, name)
        assert torch.equal(value, hf_tensors[name]), name
        value.zero_()  # a copy: the model keeps its weights
        assert torch.equal(model.checkpoint_target(name).view, hf_tensors[name]), name


def test_read_weight_names_what_it_cannot_read(hf_tensors):
    model = _loaded(hf_tensors)
    with pytest.raises(WeightUpdateError) as excinfo:
        read_weight(model, "model.layers.0.mlp.extra_proj.weight")
    assert str(excinfo.value) == (
        "no weight named 'model.layers.0.mlp.extra_proj.weight': use an HF checkpoint name such as "
        "'model.embed_tokens.weight'"
    )
    with pytest.raises(WeightUpdateError) as excinfo:
        read_weight(model, "lm_head.weight")
    assert str(excinfo.value) == "'lm_head.weight' is not stored by this model (it is recomputed or tied)"
