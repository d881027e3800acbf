"""Token embedding and the LM head (which may share the embedding's weight), vocab-parallel over a tensor-parallel
group: each rank holds one block of vocabulary rows, padded so that every rank's block has the same size."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from omnirun.distributed.tensor_parallel import TensorParallel
from omnirun.layers.ops import Ops
from omnirun.layers.sharding import ShardTarget, Slice


def _vocab_block(vocab_size: int, tp: TensorParallel) -> tuple[int, Slice]:
    """(rows every rank holds, the real vocabulary rows this rank holds): the vocabulary padded to a multiple of the
    tp size, split into equal blocks; the last blocks may be partly or wholly padding."""
    rows = -(-vocab_size // tp.size)
    start = tp.rank * rows
    return rows, Slice(vocab_size, min(start, vocab_size), max(0, min(rows, vocab_size - start)))


class _VocabParallel(nn.Module):
    """What the embedding and an untied head share: the weight block, its padding, and where its rows come from."""

    def _init_vocab(self, vocab_size: int, hidden_size: int, dtype: torch.dtype, tp: TensorParallel) -> None:
        self.vocab_size = vocab_size
        self.rows, self.real = _vocab_block(vocab_size, tp)
        self.start = tp.rank * self.rows
        self.comm, self.tp_size = tp.comm, tp.size
        self.parallel = tp.size > 1
        self.weight = nn.Parameter(torch.empty(self.rows, hidden_size, dtype=dtype), requires_grad=False)
        # Padding rows are never loaded: zeros, so that they read as nothing (and hash the same on every run).
        self.weight.data[self.real.size :].zero_()

    def checkpoint_slice(self, param_name: str = "weight") -> ShardTarget:
        """This rank's real rows of the checkpoint's [vocab, hidden] table."""
        view = self.weight.data.narrow(0, 0, self.real.size)
        return ShardTarget.of(view, (self.vocab_size, self.weight.shape[1]), 0, self.real)


class VocabEmbedding(_VocabParallel):
    def __init__(self, vocab_size: int, hidden_size: int, *, dtype: torch.dtype, tp: TensorParallel | None = None):
        super().__init__()
        self._init_vocab(vocab_size, hidden_size, dtype, tp or TensorParallel.single())

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.parallel:
            return F.embedding(input_ids, self.weight)
        # Each rank embeds the ids in its block and zeros for the others; the all-reduce puts every row together.
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.rows)
        hidden = F.embedding(local.masked_fill(outside, 0), self.weight)
        hidden.masked_fill_(outside.unsqueeze(-1), 0)
        return self.comm.all_reduce(hidden)


class LMHead(_VocabParallel):
    """hidden -> vocabulary logits. Tied: reads the embedding's weight (and its vocabulary block) instead of owning
    one. Under tensor parallelism each rank computes its block's logits and an all-gather joins them; the padding
    rows' logits are dropped."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        *,
        ops: Ops,
        dtype: torch.dtype,
        tied_to: VocabEmbedding | None,
        tp: TensorParallel | None = None,
    ):
        super().__init__()
        self.ops = ops
        self.prepared = None
        if tied_to is None:
            self._init_vocab(vocab_size, hidden_size, dtype, tp or TensorParallel.single())
        else:
            for attr in ("vocab_size", "rows", "real", "start", "comm", "tp_size", "parallel"):
                setattr(self, attr, getattr(tied_to, attr))
            self.weight = tied_to.weight  # the same Parameter: one tensor in memory, one name in named_parameters
        self.tied = tied_to is not None
        self.padded = self.rows * self.tp_size != self.vocab_size

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.ops.linear(hidden, self.weight, None, self.prepared)
        if not self.parallel:
            return logits
        logits = self.comm.all_gather(logits, dim=-1)
        return logits[..., : self.vocab_size].contiguous() if self.padded else logits

    def prepare(self) -> None:
        """As Linear.prepare: the head is the largest matrix of a small model."""
        self.prepared = self.ops.prepare_linear(self.weight)
