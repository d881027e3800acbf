"""This rank's place in the tensor-parallel group, as the model's layers see it.

Layers read `rank` and `size` to pick their slice of each weight, and call `comm` for the all-reduce after a
row-parallel matmul and the all-gather of vocab-parallel logits. At size 1 every collective is a no-op, so the
single-device model is the same code with nothing split.
"""

from __future__ import annotations

import dataclasses

from omnirun.distributed.communicator import Communicator


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    rank: int
    size: int
    comm: Communicator  # device collectives over the tensor-parallel group (the platform's communicator)

    @classmethod
    def single(cls) -> TensorParallel:
        """No split: one rank holds every weight."""
        return cls(rank=0, size=1, comm=_SoloCommunicator())

    @property
    def is_first(self) -> bool:
        """Rank 0: the one that adds row-parallel biases (once, before the all-reduce sums the ranks)."""
        return self.rank == 0


class _SoloCommunicator(Communicator):
    """A group of one without touching torch.distributed (models built outside any process group, e.g. in tests)."""

    def __init__(self) -> None:
        self.group = None
        self.world_size = 1
        self.rank = 0
