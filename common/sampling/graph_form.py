"""The sampler in a decode graph: one general form that serves any mix of greedy, temperature, top-k, top-p and
min-p rows, reading its parameters from fixed device tensors that one host-to-device copy refreshes per step.

A graph holds what the eager sampler (omnirun.sampling.sampler) launches after the forward pass: the argmax, the op
table's `sample` with every flag set (a row's token then depends on the row alone: the reference's and the Triton
kernel's do), the choice between them, and the logprobs. Its parameters are the rows of one int64 tensor laid out
as `ROWS` (floats as the bits of float64s, cast to float32 in the graph as the eager copy rounds them), built on
the host the way `SamplingBatch.build` builds them, random keys included: a step replayed here draws the same
tokens as the same step sampled eagerly.

What the form cannot serve runs eagerly after the forward pass (`serves`): penalties, logit bias, min_tokens not
yet reached, a grammar's bitmask, more top logprobs than the graph lists, and a `sample` op that does not say it
serves graphs (a `graph_widths` attribute: the short-list widths, omnirun.sampling.shortlist, to capture one
sampler for each).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from omnirun.sampling.params import SamplingParams
from omnirun.sampling.sampler import LISTED_TOP_LOGPROBS, SamplingBatch, host_flags, random_keys
from omnirun.sampling.shortlist import graph_width, shortlist

# The rows of the static parameters; the first three hold float64 bits.
ROWS = ("temperature", "top_p", "min_p", "top_k", "key", "greedy", "list_length", "list_nucleus")
_FLOATS = 3
# Top logprobs a graph lists for each row (a step asking for more samples eagerly).
GRAPH_TOP_LOGPROBS = LISTED_TOP_LOGPROBS


def graph_widths(sample_op: Callable[..., torch.Tensor]) -> tuple[int, ...]:
    """The short-list widths to capture a sampler for with this `sample` op; () where it serves no graph."""
    return tuple(getattr(sample_op, "graph_widths", ()))


def serves(params: Sequence[SamplingParams], token_index: Sequence[int]) -> bool:
    """Whether a graph's sampler gives these rows what the eager sampler gives them (no bitmask assumed)."""
    for p, index in zip(params, token_index, strict=True):
        if p.penalized or p.logit_bias is not None or index < p.min_tokens:
            return False
        if p.logprobs is not None and p.logprobs > GRAPH_TOP_LOGPROBS:
            return False
    return True


def padding_rows(max_batch_size: int, vocab: int) -> torch.Tensor:
    """[len(ROWS), max_batch_size] host int64: rows that are greedy (what padding and a capture hold)."""
    return _pack([1.0], [1.0], [0.0], [vocab], [0], [1], 0, False).expand(-1, max_batch_size).contiguous()


@dataclass
class GraphStep:
    """One step's sampling as a graph replays it."""

    width: int | None  # the list width of the sampler to replay; None: greedy rows only (the forward's argmax)
    host: torch.Tensor | None  # [len(ROWS), padded] int64 on the host: the parameters to copy (None when greedy)
    max_logprobs: int  # -1: none, 0: chosen only, n: chosen and the top n


def plan_step(
    params: Sequence[SamplingParams], token_index: Sequence[int], vocab: int, padded: int, widths: Sequence[int]
) -> GraphStep | None:
    """The graph step for rows the graph serves (`serves`), padded with greedy rows; None when a sampled row's
    op serves no graph (`widths` empty). Draws the unseeded rows' keys as SamplingBatch.build draws them."""
    flags = host_flags(params)
    max_logprobs = int(flags["max_logprobs"])
    if flags["all_greedy"]:
        return GraphStep(None, None, max_logprobs)
    if not widths:
        return None
    listed = shortlist(bool(flags["any_top_k"]), bool(flags["any_top_p_alone"]), int(flags["max_top_k"]), vocab)
    length = listed.length if max(widths) > 0 else 0
    width = graph_width(length) if length else min(widths)
    greedy = [p.greedy for p in params]
    pad = padded - len(params)
    host = _pack(
        [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)] + [1.0] * pad,
        [p.top_p for p in params] + [1.0] * pad,
        [p.min_p for p in params] + [0.0] * pad,
        [p.top_k if p.top_k > 0 else vocab for p in params] + [vocab] * pad,
        random_keys(params, token_index) + [0] * pad,
        [int(g) for g in greedy] + [1] * pad,
        length,
        listed.nucleus,
    )
    return GraphStep(width, host, max_logprobs)


def _pack(temperature, top_p, min_p, top_k, key, greedy, length: int, nucleus: bool) -> torch.Tensor:
    floats = torch.tensor([temperature, top_p, min_p], dtype=torch.float64).view(torch.int64)
    n = len(greedy)
    ints = torch.tensor([top_k, key, greedy, [length] * n, [int(nucleus)] * n], dtype=torch.int64)
    return torch.cat([floats, ints])


def graph_batch(static: torch.Tensor, width: int) -> SamplingBatch:
    """The general form's SamplingBatch over static parameter rows [len(ROWS), B] (call it inside the capture: it
    casts them on the device). Every flag is set; the list is `width` wide."""
    temperature, top_p, min_p = static[:_FLOATS].view(torch.float64).float()
    top_k, key, greedy, length, nucleus = static[_FLOATS:]
    return SamplingBatch(
        temperatures=temperature,
        top_ps=top_p,
        top_ks=top_k,
        min_ps=min_p,
        greedy=greedy != 0,
        keys=key,
        all_greedy=False,
        any_top_p=True,
        any_top_k=True,
        any_min_p=True,
        max_top_k=0,
        every_top_k=False,
        any_top_p_alone=True,
        max_logprobs=-1,
        shortlist_width=width,
        shortlist_count=length,
        shortlist_nucleus=nucleus,
    )
