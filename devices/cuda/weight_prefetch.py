"""The op table's `prefetch_weights` and `join_prefetches` on cuda: a small batch's next weights read into L2 on a
side stream while the kernels before their matmuls run (`omnirun.kernels.triton.l2_prefetch`).

The side stream forks from the current stream where the model asks (after a batch's q/k/v projection) and joins it
once per forward pass, at its end: no kernel of the step waits for a prefetch, and a CUDA graph captured over the
step holds the fork and the join like any other work. Batches above `max_tokens` skip it: their attention keeps
memory busy by itself.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# Batches of up to this many tokens prefetch. Batch 256's attention reads about 200 MB a layer at near bandwidth;
# batch 32's 25 MB leaves memory mostly idle too.
PREFETCH_MAX_TOKENS = 32
# Of the L2 cache, what one fork may fill: the weights the matmul after reads first, kept while it reads them.
PREFETCH_L2_FRACTION = 0.65


class L2WeightPrefetch:
    def __init__(self, max_tokens: int = PREFETCH_MAX_TOKENS, l2_fraction: float = PREFETCH_L2_FRACTION):
        self.max_tokens, self.l2_fraction = max_tokens, l2_fraction
        self._sides: dict[int, tuple[torch.cuda.Stream, int]] = {}  # device index -> (side stream, byte budget)
        self._forked: set[int] = set()

    def prefetch_weights(self, weights: Sequence[torch.Tensor], num_tokens: int) -> None:
        """Start reading `weights`, in order, into L2 up to this GPU's budget; the current stream goes on at once."""
        if num_tokens > self.max_tokens or not weights:
            return
        from omnirun.kernels.triton.l2_prefetch import prefetch_to_l2  # imports triton

        device = weights[0].device
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in self._sides:
            l2_bytes = torch.cuda.get_device_properties(index).L2_cache_size
            self._sides[index] = torch.cuda.Stream(index), int(l2_bytes * self.l2_fraction)
        side, budget = self._sides[index]
        side.wait_stream(torch.cuda.current_stream(index))
        with torch.cuda.stream(side):
            for weight in weights:
                budget -= prefetch_to_l2(weight, budget)
                if budget < 1:
                    break
        self._forked.add(index)

    def join_prefetches(self) -> None:
        """The current stream waits for the prefetches started since the last join (before a forward pass ends)."""
        for index in self._forked:
            torch.cuda.current_stream(index).wait_stream(self._sides[index][0])
        self._forked.clear()
