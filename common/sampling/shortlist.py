"""The short list a `sample` kernel may draw from: each row's largest logits, sorted (torch.topk), sized from a
batch's host flags. Device-neutral: the Triton kernel (omnirun.kernels.triton.sample) sizes its list here, and a
decode graph (omnirun.graphs) sizes the list its captured sampler holds and tells the kernel, through a device
tensor, how long a list the same batch would have had eagerly, so that a row takes the same path in both.

A list too short for a row (its top-k's tie, or its nucleus, reaches past the end) is no error: that row searches
its whole vocabulary instead.
"""

from __future__ import annotations

from typing import NamedTuple

# Each row's max_top_k + TIE_ROOM largest logits (room for a tie at the k-th value), at most MAX_SHORTLIST (held in
# one program's registers); a longer top-k searches the whole row. Rows with top-p and no top-k list MAX_SHORTLIST.
TIE_ROOM = 16
MAX_SHORTLIST = 1024
# The list widths a decode graph captures a sampler for: a step replays the narrowest that holds its eager list.
GRAPH_WIDTHS = (0, 128, MAX_SHORTLIST)


class ShortList(NamedTuple):
    length: int  # how many of each row's largest logits are listed (0: none, every row searches its vocabulary)
    nucleus: bool  # rows with top-p and no top-k may find their nucleus in the list


def shortlist(any_top_k: bool, any_top_p_alone: bool, max_top_k: int, vocab: int) -> ShortList:
    """The list a batch with these flags gets: long (MAX_SHORTLIST) where a row has top-p without top-k, else
    max_top_k + TIE_ROOM; none without top-k or top-p-alone rows, or with a top-k beyond what a list can hold."""
    if not (any_top_k or any_top_p_alone) or max_top_k + TIE_ROOM > MAX_SHORTLIST:
        return ShortList(0, False)
    return ShortList(min(vocab, MAX_SHORTLIST if any_top_p_alone else max_top_k + TIE_ROOM), any_top_p_alone)


def graph_width(length: int) -> int:
    """The narrowest captured list width that holds a list of `length`."""
    return next(w for w in GRAPH_WIDTHS if w >= length)
