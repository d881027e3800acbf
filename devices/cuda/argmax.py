"""Greedy sampling's argmax in one launch: each row's first index of its maximum, over a large vocabulary.

torch reduces a row on one block (40 us for 128k logits on an H200) or, in chunks, in three kernels and as many
small ops. Here every (row, chunk) program reduces its chunk to one int64 key that orders as (value, -index) and
folds it into the row's key with an atomic max; the row's last program to finish (an atomic count) decodes the
token and resets the key and the count for the next launch, so no kernel clears them in between.

Keys compare values through their bits (floats made monotone as integers); a NaN goes above every number, as
torch's max picks it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from omnirun.kernels.triton.pdl import launch_options, wait_for_previous_kernel

_CHUNK = 4096
_KEY_FLOOR = tl.constexpr(-(2**63))  # below every key: the reset value of a row's running maximum
_BELOW_EVERY_VALUE = tl.constexpr(-(2**31))  # the value key of the masked tail of a row's last chunk


@triton.jit
def _argmax_kernel(
    logits_ptr,
    stride_row,
    vocab,
    keys_ptr,
    counts_ptr,
    out_ptr,
    NUM_CHUNKS: tl.constexpr,
    CHUNK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_previous_kernel(USE_PDL)
    row = tl.program_id(0)
    offs = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    mask = offs < vocab
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_row + offs, mask=mask, other=float("-inf")).to(tl.float32)
    bits = x.to(tl.int32, bitcast=True)
    value_key = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negative floats' magnitude bits flipped: integer order
    value_key = tl.where(x != x, 0x7FFFFFFF, value_key)  # every NaN above every number, as torch's max
    value_key = tl.where(mask, value_key, _BELOW_EVERY_VALUE)
    best = tl.max(value_key, 0)
    first = tl.min(tl.where(value_key == best, offs, vocab), 0)
    # (value, -index) in one int64: the larger key has the larger value, or the same one at a smaller index.
    key = (best.to(tl.int64) << 32) | (0xFFFFFFFF - first.to(tl.int64))
    tl.atomic_max(keys_ptr + row, key)
    if tl.atomic_add(counts_ptr + row, 1) == NUM_CHUNKS - 1:  # acq_rel: every other chunk's key is in
        final = tl.atomic_xchg(keys_ptr + row, _KEY_FLOOR)
        tl.store(out_ptr + row, 0xFFFFFFFF - (final & 0xFFFFFFFF))
        tl.atomic_xchg(counts_ptr + row, 0)


class TritonArgmax:
    """The op table's `argmax` for one device: keeps the per-row keys and counts the kernel resets after itself
    (grown as batches grow; a graph captured with them keeps using the same ones)."""

    def __init__(self, pdl: bool = False):
        self.pdl = pdl
        # Per device, every (keys, counts) pair made so far, the largest last: outgrown ones stay alive, since a
        # graph that captured a launch keeps their addresses.
        self._scratch_made: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def _scratch(self, rows: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        made = self._scratch_made.setdefault(device, [])
        if not made or made[-1][0].numel() < rows:
            size = max(rows, 2 * made[-1][0].numel() if made else 1024)
            keys = torch.full((size,), _KEY_FLOOR.value, dtype=torch.int64, device=device)
            made.append((keys, torch.zeros(size, dtype=torch.int32, device=device)))
        return made[-1]

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        rows, vocab = logits.shape
        out = torch.empty(rows, dtype=torch.int64, device=logits.device)
        if rows == 0:
            return out
        if logits.stride(1) != 1:
            logits = logits.contiguous()
        keys, counts = self._scratch(rows, logits.device)
        chunks = triton.cdiv(vocab, _CHUNK)
        _argmax_kernel[(rows, chunks)](
            logits,
            logits.stride(0),
            vocab,
            keys,
            counts,
            out,
            NUM_CHUNKS=chunks,
            CHUNK=_CHUNK,
            USE_PDL=self.pdl,
            num_warps=8,
            **launch_options(self.pdl),
        )
        return out
