"""Token embedding and the LM head (which may share the embedding's weight)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from omnirun.layers.ops import Ops


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, *, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    """hidden -> vocabulary logits. Tied: reads the embedding's weight instead of owning one."""

    def __init__(
        self, vocab_size: int, hidden_size: int, *, ops: Ops, dtype: torch.dtype, tied_to: VocabEmbedding | None
    ):
        super().__init__()
        self.ops = ops
        self.prepared = None
        if tied_to is None:
            self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype), requires_grad=False)
        else:
            self.weight = tied_to.weight  # the same Parameter: one tensor in memory, one name in named_parameters
        self.tied = tied_to is not None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(hidden, self.weight, None, self.prepared)

    def prepare(self) -> None:
        """As Linear.prepare: the head is the largest matrix of a small model."""
        self.prepared = self.ops.prepare_linear(self.weight)
