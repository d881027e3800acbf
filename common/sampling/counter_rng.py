"""Counter-based random numbers for sampling: every draw is a hash of (the row's key, the vocabulary index), so a
seeded request's draw depends on its seed and token index alone, never on its batch, its row or the other rows;
no generator object is made per row, nothing waits for the host, and a device graph can replay it.

The hash is splitmix64's finaliser (Vigna, splitmix64.c) in wrapping int64 arithmetic: torch here, and the same
steps in the Triton sampling kernel (omnirun.kernels.triton.sample), so both draw the same numbers for a key. Row
keys are made on the host (`row_key`), where the batch's parameters are collected anyway.
"""

from __future__ import annotations

import torch


def as_int64(value: int) -> int:
    """The int64 with the low 64 bits of `value` (a seed of any size; a 64-bit constant)."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


GOLDEN = as_int64(0x9E3779B97F4A7C15)  # splitmix64's increment
MIX_1 = as_int64(0xBF58476D1CE4E5B9)
MIX_2 = as_int64(0x94D049BB133111EB)
# 24 random bits make a float32 uniform in (0, 1] exactly; its exponential draw is at most 16.6.
UNIFORM_BITS = 24
# exp(-log(1)) = 0 would make 0 / 0 for a filtered token: the race divides by at least this.
Q_MIN = torch.finfo(torch.float32).tiny


def _shift_right(x: torch.Tensor, n: int) -> torch.Tensor:
    """x >> n on the bits of an int64 (a logical shift: torch's >> keeps the sign)."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors (the Triton kernel's `_mix`)."""
    x = (x ^ _shift_right(x, 30)) * MIX_1
    x = (x ^ _shift_right(x, 27)) * MIX_2
    return x ^ _shift_right(x, 31)


_MASK = (1 << 64) - 1


def _mix_int(x: int) -> int:
    """`mix` of one number, on the host (unsigned 64-bit arithmetic)."""
    x &= _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def row_key(seed: int, token_index: int) -> int:
    """The key of a row's draw, on the host, as an int64: its request's seed and the index of the output token it
    samples, mixed; what a batch copies to the device with its parameters."""
    return as_int64(_mix_int(_mix_int(seed + GOLDEN) + token_index * GOLDEN))


def exponentials(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, vocab] float32 draws of Exponential(1), one per (row key, token id), never below Q_MIN."""
    ids = torch.arange(1, vocab + 1, dtype=torch.int64, device=keys.device)
    bits = _shift_right(mix(keys[:, None] + ids * GOLDEN), 64 - UNIFORM_BITS)
    uniform = (bits + 1).to(torch.float32) * (2.0**-UNIFORM_BITS)  # (0, 1]
    return (-torch.log(uniform)).clamp_(min=Q_MIN)
