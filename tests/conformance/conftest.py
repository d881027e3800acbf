"""Tiny random HF checkpoints of every supported architecture, saved with `save_pretrained` (safetensors), once in
one file and once sharded with an index; HF transformers is the reference they are compared against."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from omnirun.testing import tiny_configs, tiny_hf_model


@dataclasses.dataclass
class Checkpoint:
    name: str
    hf_model: torch.nn.Module  # float32, on the lane's device
    plain: Path  # one model.safetensors
    sharded: Path  # several shards + model.safetensors.index.json


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory, platform) -> dict[str, Checkpoint]:
    out = {}
    for name in tiny_configs():
        model = tiny_hf_model(name)
        root = tmp_path_factory.mktemp(name)
        model.save_pretrained(root / "plain")
        model.save_pretrained(root / "sharded", max_shard_size="40KB")
        assert (root / "sharded" / "model.safetensors.index.json").exists()
        out[name] = Checkpoint(name, model.to(platform.device()), root / "plain", root / "sharded")
    return out
