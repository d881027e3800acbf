"""Token-granular KV tables for aiter's kernels: omnirun's pool read as pages of one token.

aiter's ragged paged decode (and the gather before its varlen prefill) reads each request's keys through a CSR
table: kv_indptr [batch + 1] and kv_indices [keys], one KV slot per key. With pages of one token the table does
not depend on the pool's page size, so every omnirun pool fits it (SGLang's aiter backend reads its token pool the
same way). Lengths come from the batch's host copies; the slots are gathered on the device: nothing waits on it.
"""

from __future__ import annotations

import torch


def token_table(
    req_to_token: torch.Tensor, rows: torch.Tensor, starts_cpu: torch.Tensor, ends_cpu: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(kv_indptr, kv_indices), int32 on the table's device: request i reads positions starts_cpu[i] (inclusive)
    to ends_cpu[i] (exclusive) of row rows[i] of `req_to_token`."""
    starts, ends = starts_cpu.to(torch.int64), ends_cpu.to(torch.int64)
    lens = ends - starts
    if (lens < 0).any():
        raise ValueError("a request's table ends before it starts")
    indptr = torch.zeros(lens.numel() + 1, dtype=torch.int64)
    torch.cumsum(lens, 0, out=indptr[1:])
    total = int(indptr[-1])
    device = req_to_token.device
    # One host-to-device copy; output_size keeps repeat_interleave from reading its total back from the device.
    host = torch.stack([lens, indptr[:-1], starts]).to(device, non_blocking=True)
    request = torch.repeat_interleave(torch.arange(lens.numel(), device=device), host[0], output_size=total)
    position = torch.arange(total, device=device) - host[1][request] + host[2][request]
    indices = req_to_token[rows.to(device)[request], position].to(torch.int32)
    return indptr.to(device=device, dtype=torch.int32, non_blocking=True), indices


def window_starts(seq_lens_cpu: torch.Tensor, window: int | None) -> torch.Tensor:
    """First position a decode query still sees: it sees itself and the window - 1 keys before it."""
    if window is None:
        return torch.zeros_like(seq_lens_cpu)
    return (seq_lens_cpu - window).clamp(min=0)
