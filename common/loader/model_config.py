"""The model's transformers config, the dtype it runs in on this device, and its context length."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from transformers import AutoConfig, PretrainedConfig

from omnirun.config import LOAD_FORMATS
from omnirun.errors import ConfigError, ModelLoadError
from omnirun.facts import Capabilities
from omnirun.loader.presets import PRESETS, preset_config

logger = logging.getLogger(__name__)

# --dtype spellings -> torch dtype ("auto" is handled separately).
DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def load_model_config(model: str, load_format: str) -> PretrainedConfig:
    """The transformers config of `model`: an HF model directory, or with load_format "dummy" also a preset name.

    With "dummy" an existing directory wins over a preset of the same name; its weights are never read.
    """
    if load_format not in LOAD_FORMATS:
        raise ConfigError(f"--load-format {load_format!r} is unknown: choose one of {'|'.join(LOAD_FORMATS)}")
    path = Path(model)
    if load_format == "dummy":
        if path.is_dir():
            return _config_from_dir(path)
        if model in PRESETS:
            return preset_config(model)
        raise ModelLoadError(
            f"--model {model!r} is neither a model directory nor a preset: with --load-format dummy use a directory "
            f"holding config.json or one of {', '.join(PRESETS)}"
        )
    if not path.is_dir():
        hint = f" (to run the {model!r} preset with random weights add --load-format dummy)" if model in PRESETS else ""
        raise ModelLoadError(f"model directory {model} does not exist: pass --model <dir with config.json>{hint}")
    return _config_from_dir(path)


def _config_from_dir(path: Path) -> PretrainedConfig:
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} has no config.json: pass --model a Hugging Face model directory")
    try:
        # Local files only and never remote code: a config must not run code or reach the network.
        return AutoConfig.from_pretrained(str(path), trust_remote_code=False, local_files_only=True)
    except Exception as exc:  # transformers raises ValueError, KeyError, OSError, JSON errors, ...
        message = " ".join(str(exc).split())
        raise ModelLoadError(f"cannot load {path / 'config.json'}: {message}") from exc


def checkpoint_dtype(config: PretrainedConfig) -> torch.dtype | None:
    """The dtype the checkpoint was saved in, per its config (`dtype`, formerly `torch_dtype`); None if unknown."""
    value = getattr(config, "dtype", None)
    if value is None:
        value = getattr(config, "torch_dtype", None)
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str):
        dtype = getattr(torch, value.removeprefix("torch."), None)
        if isinstance(dtype, torch.dtype):
            return dtype
        if value != "auto":
            logger.warning("config.json names an unknown dtype %r; using the device's best dtype", value)
    return None


def resolve_model_dtype(name: str, config: PretrainedConfig, capabilities: Capabilities) -> torch.dtype:
    """The dtype to run the model in for `--dtype name` on a device with `capabilities`.

    "auto": the checkpoint's dtype when the device computes in it, else the device's best dtype (also when the
    config names none). An explicit dtype must be one the device supports.
    """
    supported = capabilities.model_dtypes
    if name == "auto":
        saved = checkpoint_dtype(config)
        if saved is not None and saved in supported:
            return saved
        if saved is not None:
            logger.info(
                "checkpoint dtype %s is not a compute dtype of %s; running in %s",
                saved,
                capabilities.device_name,
                supported[0],
            )
        return supported[0]
    dtype = DTYPE_NAMES.get(name)
    if dtype is None:
        raise ConfigError(f"--dtype {name!r} is unknown: choose one of auto, {', '.join(DTYPE_NAMES)}")
    if dtype not in supported:
        names = ", ".join(str(d).removeprefix("torch.") for d in supported)
        raise ConfigError(f"--dtype {name} is not supported on {capabilities.device_name}: use auto or one of {names}")
    return dtype


# Set to 1 to serve past the model's max_position_embeddings on purpose (vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN).
ALLOW_LONG_CONTEXT_ENV = "OMNIRUN_ALLOW_LONG_CONTEXT"


def context_length(config: PretrainedConfig, override: int | None) -> int:
    """The longest sequence (prompt + output) to serve: the model's max_position_embeddings unless overridden.

    An override past it is refused (positions the model never saw give garbage) unless $OMNIRUN_ALLOW_LONG_CONTEXT
    is 1, which logs a warning instead."""
    native = getattr(config, "max_position_embeddings", None)
    if override is None:
        if not isinstance(native, int) or native < 1:
            raise ModelLoadError("the model config has no max_position_embeddings: pass --context-length <tokens>")
        return native
    if isinstance(override, bool) or not isinstance(override, int) or override < 1:
        raise ConfigError(f"--context-length must be an integer >= 1, got {override!r}")
    if isinstance(native, int) and override > native:
        if os.environ.get(ALLOW_LONG_CONTEXT_ENV, "").strip().lower() not in ("1", "true"):
            raise ConfigError(
                f"--context-length {override} exceeds the model's max_position_embeddings {native}: use at most "
                f"{native}, or set {ALLOW_LONG_CONTEXT_ENV}=1 to allow it (outputs past {native} may degrade)"
            )
        logger.warning(
            "--context-length %d exceeds the model's max_position_embeddings %d (allowed by %s=1); outputs past %d "
            "may degrade",
            override,
            native,
            ALLOW_LONG_CONTEXT_ENV,
            native,
        )
    return override
