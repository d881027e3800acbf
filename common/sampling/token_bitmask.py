"""The torch reference of the `apply_token_bitmask` op: the logits of the tokens a grammar forbids set to -inf.

The bitmask is xgrammar's layout: int32 [B, ceil(V / 32)], bit t % 32 of word t // 32 set when token t is allowed;
a row of all ones (-1) allows everything. Out of place: the raw logits stay what logprobs report.
"""

from __future__ import annotations

import torch


def allocate_token_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """A host bitmask allowing every token of every row."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [B, V] with each row's forbidden tokens at -inf (a new tensor of the logits' dtype)."""
    vocab = logits.shape[-1]
    bits = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).bool().flatten(1)[:, :vocab]
    return logits.masked_fill(~allowed, float("-inf"))
