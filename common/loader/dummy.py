"""Seeded random weights for `--load-format dummy`: real shapes, no checkpoint, reproducible from the seed."""

from __future__ import annotations

import hashlib

import torch

# Dtypes every backend can draw normals in directly; others (fp8, ints) are drawn in float32 and cast.
_NORMAL_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
WEIGHT_STD = 0.02
BIAS_STD = 0.01


def param_seed(seed: int, name: str) -> int:
    """A stable 63-bit seed for one parameter: the same on every run and process (unlike Python's salted hash)."""
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _is_norm_weight(name: str, param: torch.Tensor) -> bool:
    # RMSNorm/LayerNorm scales ("input_layernorm.weight", "model.norm.weight", "q_norm.weight"): ones, as at init.
    return param.dim() == 1 and name.endswith("norm.weight")


@torch.no_grad()
def init_dummy_weights(model: torch.nn.Module, seed: int) -> None:
    """Fill every parameter of `model` in place, on its own device and dtype, from (seed, parameter name).

    Each parameter gets its own generator seeded from its name, so the result does not depend on module order:
    norm scales are ones, biases normal(0, 0.01), other weights normal(0, 0.02). Buffers (e.g. rotary tables)
    are left alone.
    """
    for name, param in model.named_parameters():
        if param.is_meta:  # nothing to fill yet; the caller materialises it first
            continue
        if _is_norm_weight(name, param):
            param.fill_(1.0)
            continue
        std = BIAS_STD if name.endswith("bias") else WEIGHT_STD
        generator = torch.Generator(device=param.device)
        generator.manual_seed(param_seed(seed, name))
        if param.dtype in _NORMAL_DTYPES:
            param.normal_(0.0, std, generator=generator)
        else:
            values = torch.empty(param.shape, dtype=torch.float32, device=param.device)
            param.copy_(values.normal_(0.0, std, generator=generator))
