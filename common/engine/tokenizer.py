"""The tokenizer of a model, found and loaded before the model is (a bad path must not cost a model load)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omnirun.errors import ConfigError, ModelLoadError


def _has_tokenizer(path: Path) -> bool:
    return path.is_dir() and any(path.glob("tokenizer*"))


def tokenizer_dir(tokenizer: str | None, model: str) -> Path | None:
    """Where the tokenizer is: `tokenizer` when given (it must hold one), else the model directory when it holds
    one, else None (the model then takes token-id prompts only)."""
    if tokenizer is None:
        return Path(model) if _has_tokenizer(Path(model)) else None
    path = Path(tokenizer)
    if not path.exists():
        raise ConfigError(f"--tokenizer {tokenizer}: no such directory; give an HF tokenizer directory")
    if not _has_tokenizer(path):
        raise ConfigError(
            f"--tokenizer {tokenizer} holds no tokenizer (no tokenizer.json, tokenizer.model or "
            "tokenizer_config.json): give an HF tokenizer directory"
        )
    return path


def load_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:  # transformers raises many kinds
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ModelLoadError(f"cannot load the tokenizer in {path}: {first_line}") from exc
