"""Which part of a checkpoint tensor this rank holds, and where in its parameters that part lives.

A tensor-parallel layer keeps only its rank's block of each weight. `Slice` says which block along one dimension;
`ShardTarget` ties a checkpoint tensor (by its full shape) to the parameter rows or columns it fills, so loading,
updates and reads by name all go through one record.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class Slice:
    """A block of `size` indices starting at `start`, out of `full` along one dimension of a checkpoint tensor."""

    full: int
    start: int
    size: int

    @classmethod
    def whole(cls, n: int) -> Slice:
        return cls(full=n, start=0, size=n)

    @property
    def is_whole(self) -> bool:
        return self.start == 0 and self.size == self.full

    @property
    def end(self) -> int:
        return self.start + self.size


def as_slice(size: int | Slice) -> Slice:
    return size if isinstance(size, Slice) else Slice.whole(size)


@dataclasses.dataclass(frozen=True)
class ShardTarget:
    """This rank's `view` of one checkpoint tensor of shape `full_shape`: indices [start, start + length) along `dim`
    (dim None: the whole tensor, replicated on every rank)."""

    view: torch.Tensor
    full_shape: tuple[int, ...]
    dim: int | None = None
    start: int = 0
    length: int = 0

    @classmethod
    def of(cls, view: torch.Tensor, full_shape: tuple[int, ...], dim: int, part: Slice) -> ShardTarget:
        """The target of `part` along `dim`; a part that is the whole dimension is recorded as unsplit."""
        if part.is_whole:
            return cls(view, tuple(full_shape))
        return cls(view, tuple(full_shape), dim, part.start, part.size)

    @property
    def index(self) -> tuple[slice, ...] | None:
        """What to read of the full tensor (for `tensor[index]` or a safetensors slice); None: all of it."""
        if self.dim is None:
            return None
        return (slice(None),) * self.dim + (slice(self.start, self.start + self.length),)

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of a full tensor (a view, no copy)."""
        return full if self.dim is None else full.narrow(self.dim, self.start, self.length)
