"""What one forward pass computes: the ForwardBatch the scheduler hands the runner.

A batch is EXTEND (prefill: each request appends one or more tokens, possibly after a prefix already in the KV
cache, possibly one chunk of a longer prompt), DECODE (each request appends exactly one token) or IDLE (this rank
has nothing to run but must still take part in collectives). Tensors the kernels read live on the device; their
host copies (`*_cpu`) let backends plan without a device sync.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence

import torch

from omnirun.memory import KVMemory


class ForwardMode(enum.Enum):
    EXTEND = "extend"
    DECODE = "decode"
    IDLE = "idle"


@dataclasses.dataclass
class ForwardBatch:
    mode: ForwardMode
    input_ids: torch.Tensor  # [num_tokens] int64: the new tokens of every request, request after request
    positions: torch.Tensor  # [num_tokens] int64: each token's position in its sequence
    req_pool_indices: torch.Tensor  # [batch] int64: each request's row in the request-to-token table
    seq_lens: torch.Tensor  # [batch] int32: tokens in the KV cache per request once this step has run
    out_cache_loc: torch.Tensor  # [num_tokens] int64: KV slot each new token is written to
    seq_lens_cpu: torch.Tensor  # host copy of seq_lens
    extend_prefix_lens_cpu: torch.Tensor  # [batch] int32, host: tokens already cached before this step
    extend_seq_lens_cpu: torch.Tensor  # [batch] int32, host: new tokens per request (all 1 in DECODE)
    # Logits for every new token (tests) rather than only each request's last one.
    return_full_logits: bool = False
    # [rows] int64: the new tokens whose logits the step returns, when some request needs more than its last one
    # (prompt logprobs: every token of its chunk); None: each request's last token.
    logit_rows: torch.Tensor | None = None
    # Some input_ids were filled on the device from tokens not yet seen by the host (overlap scheduling): the other
    # ranks of a tensor-parallel group receive them by broadcast, not in the step's host message.
    input_ids_pending: bool = False
    # What the batch was built from, on the host: the step's message to the other ranks of a tensor-parallel group.
    host: HostBatch | None = None
    # The device copy of `host.ints`, of which input_ids, positions, out_cache_loc and req_pool_indices are views,
    # and the seq_lens cast from it (so that a batch whose seq_lens was replaced since is seen not to match it).
    device_ints: torch.Tensor | None = None
    device_ints_seq_lens: torch.Tensor | None = dataclasses.field(default=None, repr=False)

    @property
    def batch_size(self) -> int:
        return int(self.seq_lens_cpu.numel())

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    def decode_inputs(self) -> torch.Tensor | None:
        """A decode batch's int inputs as one [5, batch] int64 tensor (rows: input_ids, positions, out_cache_loc,
        req_pool_indices, seq_lens), for a graph runner to copy in one go; None unless the batch's tensors are still
        the views `HostBatch.to_device` made (a field replaced since, e.g. by padding, is not in it)."""
        packed, bs = self.device_ints, self.batch_size
        if self.mode is not ForwardMode.DECODE or packed is None or packed.numel() != 5 * bs:
            return None
        rows = packed.view(5, bs)
        views = (self.input_ids, self.positions, self.out_cache_loc, self.req_pool_indices)
        if any(t.data_ptr() != row.data_ptr() for t, row in zip(views, rows[:4], strict=True)):
            return None
        return rows if self.seq_lens is self.device_ints_seq_lens else None

    @classmethod
    def idle(cls, device: torch.device) -> ForwardBatch:
        empty_long = torch.empty(0, dtype=torch.int64, device=device)
        empty_int = torch.empty(0, dtype=torch.int32)
        return cls(
            ForwardMode.IDLE,
            empty_long,
            empty_long,
            empty_long,
            empty_int.to(device),
            empty_long,
            empty_int,
            empty_int,
            empty_int,
        )


@dataclasses.dataclass
class HostBatch:
    """A ForwardBatch as host tensors: cheap to pickle, rebuilt on a device with one copy (`to_device`)."""

    mode: ForwardMode
    ints: torch.Tensor  # int64: input_ids, positions, out_cache_loc (num_tokens each), then rows and seq_lens
    extend_prefix_lens_cpu: torch.Tensor
    extend_seq_lens_cpu: torch.Tensor
    return_full_logits: bool = False
    logit_rows: torch.Tensor | None = None
    input_ids_pending: bool = False
    # Table entries of prefixes shared from the prefix cache into the batch's rows ([3, n]: rows, positions, slots):
    # rank 0 wrote them with the batch's own (KVMemory.alloc_step); the other ranks write them from here.
    prefix_entries: torch.Tensor | None = None

    def to_device(self, device: torch.device) -> ForwardBatch:
        n = self.extend_seq_lens_cpu.numel()
        tokens = (self.ints.numel() - 2 * n) // 3
        device_ints = self.ints.to(device, non_blocking=True)
        input_ids, positions, out_loc, rows, seq_lens = device_ints.split([tokens, tokens, tokens, n, n])
        seq_lens = seq_lens.int()
        return ForwardBatch(
            mode=self.mode,
            input_ids=input_ids,
            positions=positions,
            req_pool_indices=rows,
            seq_lens=seq_lens,
            out_cache_loc=out_loc,
            seq_lens_cpu=self.ints[3 * tokens + n :].int(),
            extend_prefix_lens_cpu=self.extend_prefix_lens_cpu,
            extend_seq_lens_cpu=self.extend_seq_lens_cpu,
            return_full_logits=self.return_full_logits,
            logit_rows=None if self.logit_rows is None else self.logit_rows.to(device, non_blocking=True),
            input_ids_pending=self.input_ids_pending,
            host=self,
            device_ints=device_ints,
            device_ints_seq_lens=seq_lens,
        )


def build_batch(
    kv: KVMemory,
    rows: Sequence[int],
    prefix_lens: Sequence[int],
    new_token_ids: Sequence[Sequence[int]],
    device: torch.device,
    *,
    return_full_logits: bool = False,
    every_logit: Sequence[bool] | None = None,
) -> ForwardBatch | None:
    """Allocate KV slots for each request's new tokens and describe the step; None when the pool is full.

    Request i (KV row `rows[i]`, with `prefix_lens[i]` tokens already cached) appends `new_token_ids[i]`. The mode
    is DECODE when every request appends exactly one token, else EXTEND. `every_logit[i]`: the logits of each of
    request i's new tokens, not only of its last (in request order; see `logit_counts`).
    """
    extend_lens = [len(ids) for ids in new_token_ids]
    if not rows or min(extend_lens) < 1:
        raise ValueError("a batch needs at least one request and at least one new token per request")
    ends = [start + n for start, n in zip(prefix_lens, extend_lens, strict=True)]
    slots = kv.alloc_step(rows, prefix_lens, ends)
    if slots is None:
        return None
    out_cache_loc, positions = slots.out_cache_loc, slots.positions
    flat_ids = torch.tensor([token for ids in new_token_ids for token in ids], dtype=torch.int64)
    rows_t = torch.tensor(rows, dtype=torch.int64)
    seq_lens_cpu = torch.tensor(ends, dtype=torch.int32)
    every_logit = every_logit if every_logit is not None and any(every_logit) else None
    wide = return_full_logits or every_logit is not None
    mode = ForwardMode.DECODE if max(extend_lens) == 1 and not wide else ForwardMode.EXTEND
    logit_rows = None
    if every_logit is not None:  # each request's last `count` tokens, in request order
        token_ends = torch.tensor(extend_lens).cumsum(0).tolist()
        counts = logit_counts(extend_lens, every_logit)
        logit_rows = torch.tensor([t for end, n in zip(token_ends, counts, strict=True) for t in range(end - n, end)])
    # One host-to-device copy for every per-token and per-request tensor of the step, then views of it.
    host = HostBatch(
        mode=mode,
        ints=torch.cat([flat_ids, positions, out_cache_loc, rows_t, seq_lens_cpu.long()]),
        extend_prefix_lens_cpu=torch.tensor(prefix_lens, dtype=torch.int32),
        extend_seq_lens_cpu=torch.tensor(extend_lens, dtype=torch.int32),
        return_full_logits=return_full_logits,
        logit_rows=logit_rows,
        prefix_entries=slots.prefix_entries,
    )
    return host.to_device(device)


def logit_counts(extend_lens: Sequence[int], every_logit: Sequence[bool] | None) -> list[int]:
    """Rows of a step's logits per request: one for each new token where `every_logit` says so, else one (its
    last token's)."""
    if every_logit is None:
        return [1] * len(extend_lens)
    return [n if every else 1 for n, every in zip(extend_lens, every_logit, strict=True)]
