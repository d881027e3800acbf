"""Loading a model's config and weights: safetensors checkpoints, dummy presets, seeded random weights."""

from __future__ import annotations

from omnirun.loader.checkpoint import SafetensorsCheckpoint, TensorSpec, read_header
from omnirun.loader.dummy import init_dummy_weights
from omnirun.loader.model_config import checkpoint_dtype, context_length, load_model_config, resolve_model_dtype
from omnirun.loader.presets import PRESETS, Preset, preset_config, preset_names

__all__ = [
    "PRESETS",
    "Preset",
    "SafetensorsCheckpoint",
    "TensorSpec",
    "checkpoint_dtype",
    "context_length",
    "init_dummy_weights",
    "load_model_config",
    "preset_config",
    "preset_names",
    "read_header",
    "resolve_model_dtype",
]
