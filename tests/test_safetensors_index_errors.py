"""A safetensors index whose weight_map is not a map of tensor names to file names is one clear error."""

from __future__ import annotations

import json

import pytest

from omnirun.errors import ModelLoadError
from omnirun.loader.checkpoint import SafetensorsCheckpoint


@pytest.mark.parametrize(
    "weight_map",
    [
        {"model.norm.weight": 1},  # a dict, but a value that is no file name
        {"model.norm.weight": "model.safetensors", "lm_head.weight": None},  # one bad value among good ones
        ["model.safetensors"],  # not a dict
    ],
)
def test_a_weight_map_that_does_not_map_names_to_files_is_refused(tmp_path, weight_map):
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ModelLoadError) as excinfo:
        SafetensorsCheckpoint(tmp_path)
    message = str(excinfo.value)
    assert "\n" not in message
    assert "is not a valid safetensors index" in message
    assert "'weight_map' must map tensor names to file names" in message
