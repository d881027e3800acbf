"""Turn the --kv-cache-dtype flag into the storage dtype of the paged KV cache on this device."""

from __future__ import annotations

from collections.abc import Callable

import torch

from omnirun.errors import ConfigError
from omnirun.facts import Capabilities

# Canonical name -> how to get its dtype. fp8 asks the platform, which knows its flavour (e4m3fn or e4m3fnuz).
_CANONICAL: dict[str, Callable[[torch.dtype, Capabilities], torch.dtype | None]] = {
    "auto": lambda model_dtype, caps: model_dtype,
    "bf16": lambda model_dtype, caps: torch.bfloat16,
    "fp16": lambda model_dtype, caps: torch.float16,
    "fp32": lambda model_dtype, caps: torch.float32,
    "fp8_e4m3": lambda model_dtype, caps: caps.fp8_e4m3_dtype,
    "fp8_e5m2": lambda model_dtype, caps: caps.fp8_e5m2_dtype,
}
_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def _resolve(name: str, model_dtype: torch.dtype, capabilities: Capabilities) -> torch.dtype | None:
    dtype = _CANONICAL[name](model_dtype, capabilities)
    return dtype if dtype in capabilities.kv_cache_dtypes else None


def supported_kv_cache_dtype_names(model_dtype: torch.dtype, capabilities: Capabilities) -> list[str]:
    """The --kv-cache-dtype values that resolve on this device, in canonical spelling."""
    return [name for name in _CANONICAL if _resolve(name, model_dtype, capabilities) is not None]


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype, capabilities: Capabilities) -> torch.dtype:
    """The KV-cache storage dtype for `--kv-cache-dtype name` ("auto": the model dtype) on this device."""
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    choices = ", ".join(supported_kv_cache_dtype_names(model_dtype, capabilities))
    if key not in _CANONICAL:
        raise ConfigError(f"--kv-cache-dtype {name!r} is unknown: choose one of {choices}")
    dtype = _resolve(key, model_dtype, capabilities)
    if dtype is None:
        what = f"{name} (model dtype {model_dtype})" if key == "auto" else name
        raise ConfigError(
            f"--kv-cache-dtype {what} is not supported on {capabilities.device_name}: choose one of {choices}"
        )
    return dtype
