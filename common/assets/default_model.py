"""Where the embedded default model lives: the tiny random Llama `omnirun generate` runs when no --model is given.

The files are made by `python tools/make_default_model.py` and installed as package data, so the path works from a
source checkout, an editable install and a wheel alike.
"""

from __future__ import annotations

from pathlib import Path

# The model directory sits beside this module (package data of `omnirun.assets`), so no resource API is needed.
DEFAULT_MODEL_DIR: Path = Path(__file__).resolve().parent / "default_model"


def default_model_dir() -> str:
    """The default model's directory as a string, ready to pass as `RunnerConfig(model=...)` or to `from_pretrained`."""
    return str(DEFAULT_MODEL_DIR)
