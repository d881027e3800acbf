"""Seeded random weights for `--load-format dummy`: real shapes, no checkpoint, reproducible from the seed.

The values belong to the checkpoint, not to the model's layout: each HF checkpoint tensor is drawn whole, from its
own name and full shape, then loaded through the same path as a real checkpoint. So a model split over N ranks
holds exactly the single-rank dummy weights, split.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import torch

from omnirun.weights import load_weights

# Dtypes every backend can draw normals in directly; others (fp8, ints) are drawn in float32 and cast.
_NORMAL_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
WEIGHT_STD = 0.02
BIAS_STD = 0.01


def param_seed(seed: int, name: str) -> int:
    """A stable 63-bit seed for one parameter: the same on every run and process (unlike Python's salted hash)."""
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def dummy_tensor(
    seed: int,
    name: str,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device | str,
    *,
    int4: bool = False,
) -> torch.Tensor:
    """The dummy value of checkpoint tensor `name`: norm scales (1-D "...norm.weight") and fp8 weights' scales ones,
    biases normal(0, 0.01), other weights normal(0, 0.02) (fp8 ones too), drawn on `device` from a generator seeded
    by (seed, name). Of a layer kept in `int4`: random 4-bit values in the packed words, zero points 8 and scales
    that give the weights a standard deviation near 0.02."""
    generator = torch.Generator(device=device)
    generator.manual_seed(param_seed(seed, name))
    if int4:
        if name.endswith("weight_packed"):
            return torch.randint(-(2**31), 2**31, shape, generator=generator, dtype=torch.int64, device=device).to(
                dtype
            )
        if name.endswith("weight_zero_point"):
            return torch.full(shape, 8, dtype=dtype, device=device)
        if name.endswith("weight_scale"):  # uniform q - 8 in -8..7 has a standard deviation of about 4.6
            values = torch.empty(shape, dtype=torch.float32, device=device).uniform_(0.5, 1.5, generator=generator)
            return (values * (WEIGHT_STD / 4.6)).to(dtype)
    if (len(shape) == 1 and name.endswith("norm.weight")) or name.endswith("weight_scale"):
        return torch.ones(shape, dtype=dtype, device=device)
    std = BIAS_STD if name.endswith("bias") else WEIGHT_STD
    draw_dtype = dtype if dtype in _NORMAL_DTYPES else torch.float32
    values = torch.empty(shape, dtype=draw_dtype, device=device).normal_(0.0, std, generator=generator)
    return values if draw_dtype == dtype else values.to(dtype)


def dummy_checkpoint(model, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full dummy tensor) for every tensor of a complete checkpoint of `model` (one with `checkpoint_names`
    and `checkpoint_target`), in the dtype and on the device of the parameter it fills."""
    names = model.checkpoint_names()
    int4 = {name.removesuffix(".weight_packed") for name in names if name.endswith(".weight_packed")}
    for name in names:
        target = model.checkpoint_target(name)
        if target is not None:
            kept = name.rpartition(".")[0] in int4
            yield name, dummy_tensor(seed, name, target.full_shape, target.view.dtype, target.view.device, int4=kept)


@torch.no_grad()
def init_dummy_weights(model: torch.nn.Module, seed: int) -> None:
    """Fill every parameter of `model` in place from (seed, checkpoint name); independent of module order.

    A model that maps checkpoint names to its parameters (the decoder, split or not) loads `dummy_checkpoint`
    through `load_weights`; any other module's parameter names are its checkpoint names, each filled whole.
    Buffers (e.g. rotary tables) are left alone.
    """
    if hasattr(model, "checkpoint_target"):
        load_weights(model, dummy_checkpoint(model, seed))
        return
    for name, param in model.named_parameters():
        if param.is_meta:  # nothing to fill yet; the caller materialises it first
            continue
        param.copy_(dummy_tensor(seed, name, tuple(param.shape), param.dtype, param.device))
