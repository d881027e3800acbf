"""The request-to-token table: for each running request, the KV slot of each of its token positions."""

from __future__ import annotations

import torch


class ReqToTokenPool:
    """`table[r, p]` is the slot of request row r's token at position p; attention kernels read it on the device.

    The table starts zeroed, so entries past a request's length point at slot 0, the zeroed padding page.
    """

    def __init__(self, max_requests: int, max_context_len: int, device: torch.device | str):
        if max_requests < 1:
            raise ValueError(f"max_requests must be >= 1, got {max_requests}")
        if max_context_len < 1:
            raise ValueError(f"max_context_len must be >= 1, got {max_context_len}")
        self.max_requests = max_requests
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        self.table = torch.zeros(max_requests, max_context_len, dtype=torch.int32, device=self.device)
        # Host-side bookkeeping only: handing out a row never touches the device.
        self._free_rows = list(range(max_requests - 1, -1, -1))  # pop() yields row 0 first
        self._in_use = [False] * max_requests

    @property
    def free_count(self) -> int:
        """Number of free rows."""
        return len(self._free_rows)

    def alloc(self) -> int | None:
        """A free row, or None when every row is taken."""
        if not self._free_rows:
            return None
        row = self._free_rows.pop()
        self._in_use[row] = True
        return row

    def free(self, row: int) -> None:
        """Give a row back. Freeing a row that is not in use raises ValueError."""
        if not 0 <= row < self.max_requests:
            raise ValueError(f"cannot free request row {row}: valid rows are 0..{self.max_requests - 1}")
        if not self._in_use[row]:
            raise ValueError(f"double free: request row {row} is not in use")
        self._in_use[row] = False
        self._free_rows.append(row)

    def in_use(self, row: int) -> bool:
        """Whether `row` is currently handed out."""
        return 0 <= row < self.max_requests and self._in_use[row]
